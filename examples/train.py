import mpitp
from mpitp.train.trainer import Options, Trainer

with mpitp.Communicator() as comm:
    t = Trainer(Options(config="tiny", data_default=True, mode="fsdp", steps=20, batch=8, seq=64), comm)
    while t.step < t.o.steps:  # or t.fit(): the whole run as `mpitp train` does it (log, checkpoints)
        rec = t.train_step()  # {"step", "loss", "lr", "grad_norm", "tokens_per_s", ...}
    every = comm.gather_object((rec["loss"], t.eval_loss(), t.memory()["total"]))  # rank 0 prints all
    if comm.rank == 0:
        for rank, (loss, eval_loss, held) in enumerate(every):
            print(rank, loss, eval_loss, held)
