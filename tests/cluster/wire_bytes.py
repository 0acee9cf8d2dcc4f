"""Per-rank: all-reduce ``reps`` times, then rank 0 prints, per node, the bytes mpitp's
counters say its ranks sent to other nodes (run by tests/test_minicluster.py, which
reads the same bytes off each node's link)."""

import json
import sys

import numpy as np
from mpi4py import MPI

import mpitp

alg, nbytes, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
comm = mpitp.Communicator()
x = np.ones(nbytes // 4, np.float32)
for _ in range(reps):
    comm.allreduce(x, algorithm=alg)
sent = MPI.COMM_WORLD.gather((comm.topology.node, comm.traffic.by_peer.get("inter", 0)), root=0)
if comm.rank == 0:
    per_node: dict[int, int] = {}
    for node, b in sent:
        per_node[node] = per_node.get(node, 0) + b
    print(json.dumps(per_node), flush=True)
comm.free()
