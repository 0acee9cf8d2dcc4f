"""Model against measurement: the two-level all-reduce on simulated nodes.

    mpiexec -n 8 python benchmarks/hierarchical.py --ranks-per-node 4

Runs ring, hierarchical and hierarchical_leader for real, prints the bytes the traffic
counters saw beside mpitp.plan's prediction (they must agree exactly; the script exits
non-zero otherwise), and the measured time beside the alpha-beta model fitted to this
machine by a ping-pong in the same run. On one machine every "node" shares the same
memory, so intra and inter links are the same link here; the model says so too. The
model assumes a core per rank; the last column scales it by ranks per core, since
oversubscribed ranks take turns on the CPUs.
"""

import argparse
import sys
import time

import numpy as np
from mpi4py import MPI

import mpitp
from mpitp.plan import allreduce as par
from mpitp.plan import profiles


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks-per-node", type=int, default=4)
    ap.add_argument("--sizes", default="65536,1048576,8388608", help="bytes per rank, comma separated")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    comm = mpitp.Communicator(ranks_per_node=args.ranks_per_node)
    prof = profiles.fit(comm.mpi)
    topo = comm.topology
    sizes_per_node = [len(r) for r in topo.nodes]
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    say(
        f"# {comm.size} ranks as {topo.num_nodes} simulated node(s) {sizes_per_node}; fitted link: "
        f"alpha {prof.intra.alpha * 1e6:.1f} us, beta {prof.intra.beta / 1e9:.2f} GB/s"
    )
    say(
        f"# {'bytes/rank':>10} {'algorithm':<20} {'inter/node meas':>16} {'predicted':>12} "
        f"{'intra/node meas':>16} {'predicted':>12} {'time meas':>11} {'model':>11} {'model x oversub':>15}"
    )
    import os

    oversub = max(1.0, comm.size / (os.cpu_count() or 1))  # every simulated node shares this machine's cores
    bad = 0
    for nbytes in (int(s) for s in args.sizes.split(",")):
        x = np.ones(nbytes // 4, np.float32)
        out = np.empty_like(x)
        for alg in ("ring", "hierarchical", "hierarchical_leader"):
            comm.traffic.reset()
            comm.allreduce(x, out=out, algorithm=alg)
            sent = comm.mpi.allgather((comm.traffic.by_peer.get("intra", 0), comm.traffic.by_peer.get("inter", 0)))
            meas = [(sum(sent[r][0] for r in ranks), sum(sent[r][1] for r in ranks)) for ranks in topo.nodes]
            pred = par.per_node_bytes(alg, sizes_per_node, nbytes, 4)
            ok = meas == pred
            bad += not ok
            comm.mpi.Barrier()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                comm.allreduce(x, out=out, algorithm=alg)
            t = comm.mpi.allreduce((time.perf_counter() - t0) / args.iters, op=MPI.MAX)
            model, _ = par.predict_time(alg, topo.num_nodes, max(sizes_per_node), nbytes, prof)
            say(
                f"  {nbytes:>10} {alg:<20} {max(b for _, b in meas):>16} {max(b for _, b in pred):>12} "
                f"{max(a for a, _ in meas):>16} {max(a for a, _ in pred):>12} {t * 1e3:>9.3f}ms {model * 1e3:>9.3f}ms"
                f" {model * oversub * 1e3:>13.3f}ms" + ("" if ok else "   <-- BYTES DIFFER")
            )
    say("# bytes: measured == predicted for every row" if not bad else f"# {bad} row(s) where bytes differ")
    comm.free()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
