"""Training: backward of every LLaMA op, FSDP/ZeRO units, sharded AdamW, checkpoints.

block.py       a decoder layer's training forward (the inference ops) and backward
grads.py       the backward of each op
layout.py      units: each decoder layer (and embedding, head) as one flat padded buffer
sharding.py    ddp · zero1 · zero2 · fsdp: who holds parameters, gradients, optimizer state
optim.py       AdamW on the owned shards, global-norm clipping, learning-rate schedule
engine.py      one training step: forward and backward through the units
data.py        token streams, windows and global batches
init.py        presets, fresh initialisation, reading a Hugging Face checkpoint's ranges
checkpoint.py  sharded, atomic, reshardable checkpoints; Hugging Face export
trainer.py     the loop behind ``mpitp train``
"""
