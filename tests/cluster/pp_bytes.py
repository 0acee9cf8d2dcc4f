"""Per-rank: load MODEL as ``--pp P`` stages (or ``--pp 1``: tensor parallelism over every
rank), prefill a batch of ROWS prompts, then time nothing and count: STEPS decode steps,
each as generate runs it (forward, then the last stage's tokens to every rank). Rank 0
prints one JSON line: per rank, the bytes its communicators' counters say it sent to other
nodes during the steps, split into point-to-point sends and collectives, and the plan's
figure for one step (tests/test_minicluster.py runs it across the two namespaced nodes).

    python tests/cluster/pp_bytes.py MODEL P ROWS STEPS
"""

import json
import sys

import numpy as np
from mpi4py import MPI

import mpitp
from mpitp.models.llama import LlamaForCausalLM
from mpitp.plan.infer import pp_boundary_bytes_per_rank

path, P, rows, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
world = mpitp.Communicator()
m = LlamaForCausalLM.from_pretrained(path, comm=world, pp=P)
comms = [m.comm] + ([m.stage.pp] if m.stage is not None else [])
cache = m.new_cache(rows, 8 + steps)
cache.valid[:, : 8 + steps] = True
ids = np.full((rows, 8), 7)
m.forward(ids, np.arange(8)[None].repeat(rows, 0), cache, last_only=True)
if m.stage is not None:
    m.stage.tokens(np.zeros(rows, np.int64) if m.is_last else None, rows)


def inter() -> dict:
    out: dict = {}
    for c in comms:
        for (coll, peer, _), (n, _) in c.traffic._cells.items():
            if peer == "inter":
                key = "send" if coll == "send" else "collectives"
                out[key] = out.get(key, 0) + n
    return out


before = inter()
for s in range(steps):
    logits = m.forward(np.full((rows, 1), 7), np.full((rows, 1), 8 + s), cache, last_only=True)
    if m.stage is not None:
        m.stage.tokens(np.zeros(rows, np.int64) if logits is not None else None, rows)
after = inter()
mine = {k: after.get(k, 0) - before.get(k, 0) for k in ("send", "collectives")}
T = m.comm.size if m.comm is not None else 1
plan = pp_boundary_bytes_per_rank(m.config, T, rows) if P > 1 and not m.is_last else 0
got = MPI.COMM_WORLD.gather({"rank": world.rank, "node": world.topology.node, **mine, "plan_send": plan}, root=0)
if world.rank == 0:
    print(json.dumps({"steps": steps, "rows": rows, "hidden": m.config.hidden_size, "ranks": got}), flush=True)
if m.stage is not None:
    m.stage.free()
world.free()
