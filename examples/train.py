import mpitp
from mpitp.train.trainer import Options, Trainer

comm = mpitp.Communicator()
t = Trainer(Options(config="tiny", data_default=True, mode="fsdp", steps=20, batch=8, seq=64), comm)
while t.step < t.o.steps:
    rec = t.train_step()  # {"step", "loss", "lr", "grad_norm", "tokens_per_s", ...}
print(comm.rank, rec["loss"], t.eval_loss(), t.memory()["total"])
