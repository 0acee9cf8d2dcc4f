"""Training: backward of every LLaMA op, FSDP/ZeRO units, sharded AdamW, checkpoints.

block.py       a decoder layer's training forward (the inference ops) and backward
backward.py    the backward of each op
layout.py      units: each decoder layer (and embedding, head) as one flat padded buffer
sharding.py    ddp · zero1 · zero2 · fsdp: who holds parameters, gradients, optimizer state
optim.py       AdamW on the owned shards, global-norm clipping, learning-rate schedule
engine.py      TrainEngine: one micro-batch forward and backward through the units
tp_layout.py   tensor parallelism, the cut: which slice of every tensor a tp rank holds (TPCut)
tensor_parallel.py  tensor parallelism, the ops: column/row/vocab-parallel forward and backward
data.py        token streams, windows and global batches
presets.py     the model sizes --config knows by name
sources.py     where parameters come from: fresh, a model directory, a checkpoint (one read)
checkpoint.py  sharded, atomic, reshardable checkpoints (their whole format); Hugging Face export
options.py     Options: every setting of a run; mpitp train's flags come from its fields
trainer.py     Trainer: setup, a step, eval, save, and fit (the loop behind ``mpitp train``)
plot.py        loss.png
"""
