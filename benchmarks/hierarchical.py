"""Model against measurement: the two-level all-reduce, on simulated or real nodes.

    mpiexec -n 8 python benchmarks/hierarchical.py --ranks-per-node 4      # simulated nodes
    bin/mpitp-minicluster up --nodes 2 --link 1gbit                         # real ones (root)
    bin/mpitp-minicluster exec -n 4 -ppn 2 -- python benchmarks/hierarchical.py --link 1gbit

On real nodes (no --ranks-per-node) each row also gives MPI's own all-reduce beside
mpitp's algorithms, and the link floor: the most inter-node bytes any node sends (the
plan's exact figure) over the link rate given by --link. ``time/floor`` near 1 means the
intra-node phases are hidden behind the network.

Runs ring, hierarchical and hierarchical_leader for real, prints the bytes the traffic
counters saw beside mpitp.plan's prediction (they must agree exactly; the script exits
non-zero otherwise), and the measured time beside the alpha-beta model fitted to this
machine by a ping-pong in the same run: on real nodes one between two ranks of a node
(intra) and one between two nodes (inter, across the link); on simulated nodes every
"node" shares the same memory, so intra and inter are the same link, and the model says so. The
model assumes a core per rank; the last column scales it by ranks per core, since
oversubscribed ranks take turns on the CPUs.
"""

import argparse
import sys
import time

import numpy as np

import mpitp
from mpitp.plan import allreduce as par
from mpitp.plan import profiles
from mpitp.units import size_list


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks-per-node", type=int, help="simulate nodes of this many ranks (default: real nodes)")
    ap.add_argument(
        "--sizes", type=size_list, default="64K,1M,8M", help="bytes per rank, comma separated (64K, 4M, ...)"
    )
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--link", help="each node's link rate (1gbit, 10gbit): adds the link floor column")
    ap.add_argument("--json", help="write the rows here (rank 0)")
    args = ap.parse_args()
    comm = mpitp.Communicator(ranks_per_node=args.ranks_per_node)
    link_bps = _rate(args.link) if args.link else None
    topo = comm.topology
    # on real nodes the inter-node link is fitted across them: the model predicts the floor
    prof = profiles.fit(comm.mpi) if topo.simulated else profiles.fit_nodes(comm.mpi, topo.nodes)
    sizes_per_node = [len(r) for r in topo.nodes]
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    kind = "simulated" if topo.simulated else "real"
    say(
        f"# {comm.size} ranks as {topo.num_nodes} {kind} node(s) {sizes_per_node}; {prof.note}"
        + (f"; inter-node link {args.link}" if args.link else "")
    )
    say(
        f"# {'bytes/rank':>10} {'algorithm':<20} {'inter/node meas':>16} {'predicted':>12} "
        f"{'intra/node meas':>16} {'predicted':>12} {'time meas':>11} {'model':>11} {'model x oversub':>15}"
        + (f" {'link floor':>11} {'time/floor':>10}" if link_bps else "")
    )
    rows = []
    import os

    oversub = max(1.0, comm.size / (os.cpu_count() or 1))  # every simulated node shares this machine's cores
    bad = 0
    for nbytes in args.sizes:
        x = np.ones(nbytes // 4, np.float32)
        out = np.empty_like(x)
        algs = (
            ("ring", "hierarchical", "hierarchical_leader")
            if topo.simulated
            else ("mpi", "ring", "hierarchical", "hierarchical_leader")
        )
        times = {}
        for alg in algs:
            comm.traffic.reset()
            comm.allreduce(x, out=out, algorithm=alg)
            if alg == "mpi":  # what MPI sends inside its own call is not visible to mpitp
                meas = pred = [(0, 0)] * topo.num_nodes
            else:
                by_peer = comm.traffic.by_peer
                sent = comm.allgather_object((by_peer.get("intra", 0), by_peer.get("inter", 0)))
                meas = [(sum(sent[r][0] for r in ranks), sum(sent[r][1] for r in ranks)) for ranks in topo.nodes]
                pred = par.per_node_bytes(alg, sizes_per_node, nbytes, 4)
            ok = meas == pred
            bad += not ok
            trials = []
            for _ in range(3):  # the median of three timed trials of --iters calls each
                comm.barrier()
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    comm.allreduce(x, out=out, algorithm=alg)
                trials.append(comm.allreduce_object((time.perf_counter() - t0) / args.iters, op="max"))
            t = times[alg] = float(np.median(trials))
            model = par.predict_time(alg, topo.num_nodes, max(sizes_per_node), nbytes, prof)[0] if alg != "mpi" else 0
            floor = max(b for _, b in pred) * 8 / link_bps if link_bps and alg != "mpi" else None
            inter = max(b for _, b in meas)
            rows.append({"bytes": nbytes, "algorithm": alg, "time_s": t, "inter_bytes": inter, "link_floor_s": floor})
            say(
                f"  {nbytes:>10} {alg:<20} {max(b for _, b in meas):>16} {max(b for _, b in pred):>12} "
                f"{max(a for a, _ in meas):>16} {max(a for a, _ in pred):>12} {t * 1e3:>9.3f}ms {model * 1e3:>9.3f}ms"
                f" {model * oversub * 1e3:>13.3f}ms"
                + (f" {floor * 1e3:>9.3f}ms {t / floor:>9.2f}x" if floor else "")
                + ("" if ok else "   <-- BYTES DIFFER")
            )
        if "mpi" in times:
            h = times["hierarchical"]
            say(
                f"  {'':>10} hierarchical is {times['mpi'] / h:.2f}x MPI's own call, "
                f"{times['ring'] / h:.2f}x the flat ring"
            )
    say("# bytes: measured == predicted for every row" if not bad else f"# {bad} row(s) where bytes differ")
    if args.json and comm.rank == 0:
        import json

        with open(args.json, "w") as f:
            json.dump({"ranks": comm.size, "nodes": sizes_per_node, "link": args.link, "rows": rows}, f, indent=1)
    comm.free()
    return 1 if bad else 0


def _rate(text: str) -> float:
    t = text.lower()
    for suffix, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if t.endswith(suffix):
            return float(t[: -len(suffix)]) * mult
    raise SystemExit(f"--link {text!r}: give a rate like 1gbit or 10gbit")


if __name__ == "__main__":
    sys.exit(main())
