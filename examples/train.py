import mpitp
from mpitp.train.trainer import Options, Trainer

comm = mpitp.Communicator()
t = Trainer(Options(config="tiny", data_default=True, mode="fsdp", steps=20, batch=8, seq=64), comm)
while t.step < t.o.steps:
    rec = t.train_step()  # {"step", "loss", "lr", "grad_norm", "tokens_per_s", ...}
every = comm.mpi.gather((rec["loss"], t.eval_loss(), t.memory()["total"]), root=0)  # rank 0 prints all
if comm.rank == 0:
    for rank, (loss, eval_loss, held) in enumerate(every):
        print(rank, loss, eval_loss, held)
