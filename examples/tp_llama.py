import sys

import mpitp

path = sys.argv[1] if len(sys.argv) > 1 else "path/to/hf-checkpoint"
comm = mpitp.Communicator()
model = mpitp.LlamaForCausalLM.from_pretrained(path, comm=comm, dtype="float32", device="cpu")
logits = model([[1, 15, 29]])  # [batch, seq, vocab], full logits on every rank
ids = model.generate([[1, 15], [1, 45, 7, 31]], max_new_tokens=8, temperature=0.0)  # greedy
print(comm.rank, logits.shape, ids)
