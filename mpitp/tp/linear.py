"""Tensor-parallel linear layers (Megatron / vLLM semantics), NumPy or CuPy.

Weights are addressed in the Hugging Face layout ``W[out, in]`` (``layer.weight``) and
stored transposed once at construction (llm.c style); ``y = x @ W.T (+ b)``. ``p`` ranks,
rank ``r``. Every layer has a ``weight_loader(param, source, shard_id)`` that reads only
this rank's slice from a :class:`~mpitp.tp.source.TensorSource` (a safetensors slice on
disk, or an array), so the checkpoint loader stays generic.

    ColumnParallelLinear: W cut by rows (output)      RowParallelLinear: W cut by columns (input)

          in                                                 in
        +------+  rank 0                            +----+----+----+
    out |======|  rank 1      y_r = x @ W_r.T   out | r0 | r1 | r2 |   y = sum_r x_r @ W_r.T
        |------|  rank 2      (sharded output)      +----+----+----+   (all-reduce, then + b)
        +------+
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import backend
from ..errors import MpitpError
from .source import TensorSource


class ShardingError(MpitpError, ValueError):
    """A layer cannot be cut over this many ranks, or a tensor has the wrong shape."""


def _divide(n: int, p: int, what: str) -> int:
    if n % p:
        raise ShardingError(f"{what} = {n} is not divisible by the tensor-parallel size {p}")
    return n // p


class LinearBase:
    """Holds ``weight`` (and ``bias``) for this rank; ``xp`` is numpy or cupy."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, comm, dtype=np.float32, xp=np):
        self.comm, self.xp, self.dtype = comm, xp, np.dtype(dtype)
        self.tp_size = comm.size if comm is not None else 1
        self.tp_rank = comm.rank if comm is not None else 0
        self.in_features, self.out_features = in_features, out_features
        # stored transposed, [in, out] contiguous: x @ W.T streams whole rows of it, which
        # is up to 2x faster for decoding (GEMV) than W's own short rows; ``weight`` is the
        # [out, in] view every loader and reader uses
        self._wt = xp.zeros((in_features, out_features), self.dtype)
        self.weight = self._wt.T
        self.bias = xp.zeros(out_features, self.dtype) if bias else None

    def _put(self, param: str, value: np.ndarray) -> None:
        dst = getattr(self, param)
        if tuple(value.shape) != tuple(dst.shape):
            raise ShardingError(f"{type(self).__name__}.{param}: slice has shape {tuple(value.shape)}, "
                                f"expected {tuple(dst.shape)}")
        dst[...] = self.xp.asarray(value, dtype=self.dtype)

    @staticmethod
    def _check_full(src: TensorSource, shape: tuple) -> None:
        if tuple(src.shape) != tuple(shape):
            raise ShardingError(f"{src.name}: checkpoint shape {tuple(src.shape)}, model expects {tuple(shape)}")

    def matmul(self, x):
        return x @ self._wt


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""

    def weight_loader(self, param: str, src: TensorSource, shard_id: Any = None) -> None:
        full = getattr(self, param).shape
        self._check_full(src, full)
        self._put(param, src.read())

    def __call__(self, x):
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias


class ColumnParallelLinear(LinearBase):
    """Rank r holds output rows ``[r*out/p, (r+1)*out/p)``; output stays sharded unless
    ``gather_output`` (then every rank gets the whole output, ranks in order)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False, comm=None,
                 gather_output: bool = False, dtype=np.float32, xp=np):
        p = comm.size if comm is not None else 1
        super().__init__(in_features, _divide(out_features, p, "output size"), bias=bias, comm=comm,
                         dtype=dtype, xp=xp)
        self.full_out = out_features
        self.gather_output = gather_output

    def weight_loader(self, param: str, src: TensorSource, shard_id: Any = None) -> None:
        full = (self.full_out, self.in_features) if param == "weight" else (self.full_out,)
        self._check_full(src, full)
        n = self.out_features
        self._put(param, src.rows(self.tp_rank * n, (self.tp_rank + 1) * n))

    def __call__(self, x):
        y = self.matmul(x)
        if self.bias is not None:
            y = y + self.bias
        if self.gather_output and self.tp_size > 1:
            y = gather_last_dim(self.comm, y)
        return y


class RowParallelLinear(LinearBase):
    """Rank r holds input columns ``[r*in/p, (r+1)*in/p)``; the partial outputs are
    all-reduced (``reduce_results``) and the bias is added once, after the reduction."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False, comm=None,
                 input_is_parallel: bool = True, reduce_results: bool = True, dtype=np.float32, xp=np):
        p = comm.size if comm is not None else 1
        super().__init__(_divide(in_features, p, "input size"), out_features, bias=bias, comm=comm,
                         dtype=dtype, xp=xp)
        self.full_in = in_features
        self.input_is_parallel, self.reduce_results = input_is_parallel, reduce_results

    def weight_loader(self, param: str, src: TensorSource, shard_id: Any = None) -> None:
        if param == "bias":
            self._check_full(src, (self.out_features,))
            self._put("bias", src.read())
            return
        self._check_full(src, (self.out_features, self.full_in))
        n = self.in_features
        self._put("weight", src.cols(self.tp_rank * n, (self.tp_rank + 1) * n))

    def __call__(self, x):
        if not self.input_is_parallel:
            n = self.in_features
            x = x[..., self.tp_rank * n:(self.tp_rank + 1) * n]
        y = self.matmul(x)
        if self.reduce_results and self.tp_size > 1:
            self.comm.allreduce(y, out=y)
        return y if self.bias is None else y + self.bias


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one weight (gate_up_proj). Locally
    ``[gate_r ; up_r]``: shard k lands at local row ``sum(output_sizes[:k]) / p``."""

    def __init__(self, in_features: int, output_sizes: list[int], *, bias: bool = False, comm=None,
                 dtype=np.float32, xp=np):
        p = comm.size if comm is not None else 1
        for k, s in enumerate(output_sizes):
            _divide(s, p, f"output_sizes[{k}]")
        self.output_sizes = list(output_sizes)
        super().__init__(in_features, sum(output_sizes), bias=bias, comm=comm, dtype=dtype, xp=xp)

    def weight_loader(self, param: str, src: TensorSource, shard_id: int = 0) -> None:
        p, r = self.tp_size, self.tp_rank
        size = self.output_sizes[shard_id]
        self._check_full(src, (size, self.in_features) if param == "weight" else (size,))
        n, off = size // p, sum(self.output_sizes[:shard_id]) // p
        dst = getattr(self, param)
        value = src.rows(r * n, (r + 1) * n)
        dst[off:off + n] = self.xp.asarray(value, dtype=self.dtype)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one weight, cut by heads. Locally ``[Q_r | K_r | V_r]``.

    With ``p <= kv_heads`` rank r holds KV heads ``[r*kv/p, (r+1)*kv/p)``; with
    ``p > kv_heads`` each rank holds one KV head, ``r // (p/kv)``, replicated on p/kv
    ranks (the query heads of a rank always share that KV head)."""

    def __init__(self, hidden_size: int, head_dim: int, total_heads: int, total_kv_heads: int, *,
                 bias: bool = False, comm=None, dtype=np.float32, xp=np):
        p = comm.size if comm is not None else 1
        self.num_heads = _divide(total_heads, p, "number of attention heads")
        if total_kv_heads % p and p % total_kv_heads:
            raise ShardingError(f"number of KV heads = {total_kv_heads} neither divides nor is divisible by "
                                f"the tensor-parallel size {p}")
        self.num_kv_heads = max(1, total_kv_heads // p)
        self.total_heads, self.total_kv_heads, self.head_dim = total_heads, total_kv_heads, head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(hidden_size, (self.num_heads + 2 * self.num_kv_heads) * head_dim * p, bias=bias,
                         comm=comm, dtype=dtype, xp=xp)

    def kv_head_start(self) -> int:
        p, r, kv = self.tp_size, self.tp_rank, self.total_kv_heads
        return r * self.num_kv_heads if p <= kv else r // (p // kv)

    def weight_loader(self, param: str, src: TensorSource, shard_id: str = "q") -> None:
        d = self.head_dim
        if shard_id == "q":
            full, start, n, off = self.total_heads * d, self.tp_rank * self.q_size, self.q_size, 0
        else:
            full, start, n = self.total_kv_heads * d, self.kv_head_start() * d, self.kv_size
            off = self.q_size + (0 if shard_id == "k" else self.kv_size)
        self._check_full(src, (full, self.in_features) if param == "weight" else (full,))
        dst = getattr(self, param)
        dst[off:off + n] = self.xp.asarray(src.rows(start, start + n), dtype=self.dtype)

    def split(self, qkv):
        q = qkv[..., :self.q_size]
        k = qkv[..., self.q_size:self.q_size + self.kv_size]
        v = qkv[..., self.q_size + self.kv_size:]
        return q, k, v


def gather_last_dim(comm, y):
    """All-gather a tensor sharded equally along its last dimension (ranks in order)."""
    xp = backend.xp_of(y)
    part = xp.moveaxis(y, -1, 0)
    full = backend.empty((part.shape[0] * comm.size,) + tuple(part.shape[1:]), y.dtype, y)
    comm.allgather(part, out=full)        # equal shards: out's shape spares the count exchange
    return xp.moveaxis(full, 0, -1)
