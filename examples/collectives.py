import numpy as np

import mpitp

comm = mpitp.Communicator()  # a Dup of MPI.COMM_WORLD
x = np.full(1 << 20, comm.rank, np.float32)
y = comm.allreduce(x, op="sum", algorithm="ring")  # new array, identical on every rank
comm.allreduce(x, out=x)  # in place ("auto": MPI for small, ring for large messages)
h = comm.allreduce(x, nonblocking=True)
y = h.wait()
rows = comm.allgather(np.arange(comm.rank + 1))  # concatenated along axis 0
mine = comm.reduce_scatter(np.ones((10, 3)))  # piece `rank` of np.array_split(sum, size)
with comm.phase("forward"):
    comm.allreduce(x)
print(comm.rank, comm.traffic.by_phase, comm.traffic.by_peer)
