"""Training on a (dp, tp) mesh across nodes: tp T x fsdp D against pure fsdp and pure TP,
in one run, with the inter-node bytes each moves per step beside ``mpitp plan train``.

    bin/mpitp-minicluster up --nodes 2 --link 1gbit                           # root
    bin/mpitp-minicluster exec -n 4 -ppn 2 -- python benchmarks/train_mesh.py
    mpiexec -n 4 python benchmarks/train_mesh.py --ranks-per-node 2            # simulated nodes
    ... python benchmarks/train_mesh.py --tp 1,2 --precision float32,bf16     # mixed precision too

Every (dp, tp) layout of the ranks (by default tp 1, 2 and 4 at 4 ranks) trains
the ``small`` config (seq 128, global batch 8, float32) on the same windows, and with
``--precision`` also FSDP2-style bf16 (``--param-dtype bfloat16 --reduce-dtype bfloat16``:
float32 masters, gathers, reductions and tp activations in bfloat16); rounds interleave the
layouts so the machine's slow spells hit all alike. Collectives are mpitp's
ring (``--algorithm``), whose traffic counters see every byte and where it went: the
script checks each rank's inter-node bytes per step against the plan (exit 1 if they
differ) and, on real nodes, reads each node's network device (``/proc/net/dev``) for the
payload that left it (its bytes less each frame's headers), read once the link is idle.
Figures: median step after the first of each round, median over rounds.
"""

import argparse
import json
import os
import sys
import time

import numpy as np

import mpitp
from mpitp.plan import profiles
from mpitp.plan.train import layout as plan_layout
from mpitp.train.presets import preset_config
from mpitp.train.trainer import Options, Trainer

FRAME_HEADERS = 66  # Ethernet 14 + IPv4 20 + TCP 32 (with timestamps) bytes a frame


def tx_bytes(dev: str = "eth0") -> int | None:
    """TCP payload sent so far through ``dev`` in this process's network namespace: its bytes
    less each frame's headers (an ACK carries none; the minicluster's link is shaped frame by
    frame, so a 1448-byte segment costs 1514)."""
    try:
        for line in open("/proc/net/dev"):
            name, _, rest = line.partition(":")
            if name.strip() == dev:
                f = rest.split()
                return int(f[8]) - FRAME_HEADERS * int(f[9])
    except OSError:
        pass
    return None


def resent_bytes() -> int:
    """Payload TCP sent again in this namespace, at most: its RetransSegs (tail-loss probes and
    retransmissions) times a full segment's 1448 bytes."""
    try:
        rows = [line.split() for line in open("/proc/net/snmp") if line.startswith("Tcp:")]
        return 1448 * int(dict(zip(rows[0], rows[1]))["RetransSegs"])
    except (OSError, KeyError, IndexError, ValueError):
        return 0


def settled_tx_bytes() -> int | None:
    """:func:`tx_bytes` once the link is idle: what a rank handed TCP may still wait in the
    link's queue (the minicluster shapes each frame) after the barrier that ended the steps."""
    last, same, t = tx_bytes(), 0, time.monotonic()
    while last is not None and same < 4 and time.monotonic() - t < 2.0:
        time.sleep(0.005)
        now = tx_bytes()
        same, last = (same + 1 if now == last else 0), now
    return last


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks-per-node", type=int, help="simulate nodes of this many ranks (default: real nodes)")
    ap.add_argument("--tp", default=None, help="tp sizes to compare, comma separated (default: all that fit)")
    ap.add_argument("--config", default="small")
    ap.add_argument("--mode", default="fsdp")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4, help="steps per round and layout (the first is not timed)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--algorithm", default="ring")
    ap.add_argument("--precision", default="float32", help="float32 and/or bf16, comma separated (default float32)")
    ap.add_argument("--json", help="write the rows here (rank 0)")
    args = ap.parse_args()
    if args.ranks_per_node:
        os.environ["MPITP_RANKS_PER_NODE"] = str(args.ranks_per_node)
    comm = mpitp.Communicator()
    topo = comm.topology
    nodes, per_node = topo.num_nodes, comm.size // topo.num_nodes
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    data = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"mpitp-train-mesh-{os.getuid()}.npy")
    if comm.rank == 0:
        np.save(data, np.random.default_rng(0).integers(0, 4096, 200_000))
    comm.barrier()
    kv = preset_config(args.config).num_key_value_heads
    sizes = [int(t) for t in args.tp.split(",")] if args.tp else [t for t in (1, 2, 4, 8) if t <= kv]
    sizes = [t for t in sizes if comm.size % t == 0]
    node_leader = comm.rank == min(topo.nodes[topo.node_of[comm.rank]])
    real = not topo.simulated and nodes > 1
    precisions = args.precision.split(",")
    if not set(precisions) <= {"float32", "bf16"}:
        ap.error(f"--precision {args.precision}: float32 and/or bf16")
    say(
        f"# {comm.size} ranks on {nodes} {'real' if real else 'simulated'} node(s) of {per_node}; "
        f"{args.config}, {args.mode}, batch {args.batch} x seq {args.seq}, {args.algorithm} collectives"
    )
    trainers = {}
    for t, prec in [(t, p) for t in sizes for p in precisions]:
        half = "bfloat16" if prec == "bf16" else None
        opts = Options(
            config=args.config,
            data=data,
            mode=args.mode,
            tp=t,
            steps=10**6,
            batch=args.batch,
            seq=args.seq,
            algorithm=args.algorithm,
            eval_fraction=0,
            progress=False,
            param_dtype=half,
            reduce_dtype=half,
        )
        trainers[t, prec] = Trainer(opts, comm)
    times: dict[tuple, list] = {k: [] for k in trainers}
    inter: dict[tuple, int] = {}
    wire: dict[tuple, list] = {k: [] for k in trainers}
    for _ in range(args.rounds):
        for key, tr in trainers.items():
            tr.train_step()  # warm: allocations, first touch
            groups = [c for c in (tr.dp, tr.tp) if c is not None]  # tp None at tp 1
            for c in groups:
                c.traffic.reset()
            comm.barrier()
            tx0 = settled_tx_bytes() if real and node_leader else None
            again0 = resent_bytes() if tx0 is not None else 0  # read where tx0 is, beside it
            comm.barrier()  # nobody sends before every node has read its counter
            steps = []
            for _ in range(args.steps - 1):
                t0 = time.perf_counter()
                tr.train_step()
                steps.append(time.perf_counter() - t0)
            comm.barrier()
            tx1 = settled_tx_bytes() if real and node_leader else None
            comm.barrier()  # nor after, before every node has read it
            times[key].append(float(np.median(steps)))
            mine = sum(c.traffic.by_peer.get("inter", 0) for c in groups) // (args.steps - 1)
            per_node_bytes = comm.allgather_object(mine)
            node_sum = max(sum(per_node_bytes[r] for r in ranks) for ranks in topo.nodes)
            inter[key] = node_sum
            if tx0 is not None and tx1 is not None:
                wire[key].append(((tx1 - tx0) / (args.steps - 1), (resent_bytes() - again0) / (args.steps - 1)))
    walls = {k: comm.allgather_object(wire[k][-1] if wire[k] else None) for k in trainers}
    prof = profiles.get("nvlink-ib200")  # bytes only: the profile does not change them
    ok = True
    rows = []
    say(
        f"# {'layout':<14} {'precision':<9} {'tokens/s':>9} {'step ms':>9} {'vs fp32':>8} "
        f"{'inter/node/step':>16} {'plan':>12} {'wire/node/step':>15}"
    )
    for (t, prec), tr in trainers.items():
        step = float(np.median(times[t, prec]))
        half = 2 if prec == "bf16" else None
        planned = plan_layout(
            tr.cfg, t, comm.size // t, nodes, args.mode, args.batch, args.seq, 4, prof,
            param_itemsize=half, reduce_itemsize=half,
        )  # fmt: skip
        want = int(planned["inter_bytes_per_node"])
        wires = [w for w in walls[t, prec] if w is not None]
        fp32 = float(np.median(times[t, "float32"])) if (t, "float32") in times else None
        row = {
            "tp": t,
            "dp": comm.size // t,
            "precision": prec,
            "tokens_per_s": args.batch * args.seq / step,
            "step_s": step,
            "step_vs_float32": step / fp32 if fp32 else None,
            "inter_bytes_per_node": inter[t, prec],
            "plan_inter_bytes_per_node": want,
            "wire_bytes_per_node": max(w for w, _ in wires) if wires else None,
            "resent_bytes_per_node": max(a for _, a in wires) if wires else None,  # sent again, at most
        }
        ok &= inter[t, prec] == want
        rows.append(row)
        say(
            f"  tp{t} x {args.mode}{comm.size // t:<4} {prec:<9} {row['tokens_per_s']:>9.0f} {step * 1e3:>9.1f} "
            + (f"{row['step_vs_float32']:>7.2f}x" if fp32 else f"{'-':>8}")
            + f" {inter[t, prec] / 1e6:>13.2f} MB {want / 1e6:>9.2f} MB"
            + (f" {row['wire_bytes_per_node'] / 1e6:>12.2f} MB" if wires else f" {'-':>15}")
        )
    for tr in trainers.values():
        tr.close()
    if comm.rank == 0:
        fastest = max(rows, key=lambda r: r["tokens_per_s"])
        fewest = min(rows, key=lambda r: r["inter_bytes_per_node"])
        print(
            f"# fastest: tp{fastest['tp']} x {args.mode}{fastest['dp']} {fastest['precision']}; fewest inter-node "
            f"bytes: tp{fewest['tp']} x {args.mode}{fewest['dp']} {fewest['precision']}; counters "
            + ("== plan for every layout" if ok else "DIFFER from the plan")
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    comm.free()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
