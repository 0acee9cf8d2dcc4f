"""Tensor-parallel linear layers (Megatron / vLLM semantics), NumPy or CuPy.

Weights are addressed in the Hugging Face layout ``W[out, in]`` (``layer.weight``) and
stored transposed once at construction (llm.c style); ``y = x @ W.T (+ b)``. ``p`` ranks,
rank ``r``. Every layer has a ``weight_loader(param, source, shard_id)`` that reads only
this rank's slice from a :class:`~mpitp.tp.source.TensorSource` (a safetensors slice on
disk, or an array), so the checkpoint loader stays generic. Cuts need not be equal:
``sizes`` gives each rank's share (default: as even as possible, differing by one), and
:mod:`mpitp.tp.partition` chooses GQA-aware, byte-balanced ones for a whole model.

    ColumnParallelLinear: W cut by rows (output)      RowParallelLinear: W cut by columns (input)

          in                                                 in
        +------+  rank 0                            +----+----+----+
    out |======|  rank 1      y_r = x @ W_r.T   out | r0 | r1 | r2 |   y = sum_r x_r @ W_r.T
        |------|  rank 2      (sharded output)      +----+----+----+   (all-reduce, then + b)
        +------+
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ..kernels.weights import formats
from . import partition
from .partition import ShardingError
from .source import TensorSource


def _cut(n: int, p: int, sizes, what: str) -> list[int]:
    """Per-rank sizes of a dimension of ``n``: ``sizes`` checked, or an even split."""
    sizes = partition.even(n, p) if sizes is None else list(sizes)
    if len(sizes) != p or sum(sizes) != n or min(sizes) < 0:
        raise ShardingError(f"{what}: sizes {sizes} do not cut {n} over {p} ranks")
    return sizes


class LinearBase:
    """Holds ``weight`` (and ``bias``) for this rank; ``xp`` is numpy or cupy.

    ``weights`` says how the weight is kept (set by the model before loading):
    ``float32`` (the array ``weight``), ``auto`` (block-quantized tensors of the file stay
    in their format, :mod:`mpitp.kernels`), ``q8_0`` (quantized at load). Block weights
    arrive in pieces (q, k, v; gate, up) and are joined by :meth:`finish` after loading."""

    weights = "float32"
    fallback = ""  # why this rank keeps float32 where block weights were asked for

    def __init__(self, in_features: int, out_features: int, *, bias: bool, comm, dtype=np.float32, xp=np):
        self.comm, self.xp, self.dtype = comm, xp, np.dtype(dtype)
        self.tp_size = comm.size if comm is not None else 1
        self.tp_rank = comm.rank if comm is not None else 0
        self.in_features, self.out_features = in_features, out_features
        # stored transposed, [in, out] contiguous: x @ W.T streams whole rows of it
        # (faster GEMV, docs/measurements.md); ``weight`` is the [out, in] view every
        # loader and reader uses
        self._wt = xp.zeros((in_features, out_features), self.dtype)
        self.weight = self._wt.T
        self.bias = xp.zeros(out_features, self.dtype) if bias else None
        self.qweight: formats.BlockWeight | formats.Pieces | None = None
        self._parts: dict[int, formats.BlockWeight] = {}  # local row offset -> piece

    def _blocks(self, src: TensorSource, rows=None, cols=None) -> formats.BlockWeight | None:
        """This rank's piece of ``src`` (rows or columns [a, b)) as block weights, or None
        to keep it as floats (``weights`` float32, CuPy, a float tensor under ``auto``, or
        a column cut that is not on block boundaries)."""
        mode = self.weights
        if mode == "float32" or self.xp is not np or len(src.shape) != 2:
            return None
        half = mode == "auto" and getattr(src, "type_name", "") in formats.HALF  # 16-bit: any column cut
        if cols is not None and not half and (cols[0] % formats.BLOCK or cols[1] % formats.BLOCK):
            self.fallback = f"input columns [{cols[0]}, {cols[1]}) are not on {formats.BLOCK}-weight block boundaries"
            return None
        if mode == "auto":
            if not getattr(src, "quantized", False):
                return None
            return src.block_rows(*rows) if rows is not None else src.block_cols(*cols)  # type: ignore[attr-defined]
        if src.shape[1] % formats.BLOCK:
            return None
        return formats.quantize_q8_0(src.rows(*rows) if rows is not None else src.cols(*cols))

    def finish(self) -> None:
        """After loading: join the block pieces into ``qweight``. Pieces of different
        kinds (a Q4_K_M file's Q4_K q/k beside its Q6_K v) stay as they are, side by side
        (:class:`~mpitp.kernels.weights.formats.Pieces`: each its own kernel); a part left as
        floats makes the whole weight float32."""
        parts, self._parts = sorted(self._parts.items()), {}
        if not parts:
            return
        covered = sum(p.shape[0] for _, p in parts) == self.out_features
        if covered:
            self.qweight = formats.join_pieces([p for _, p in parts])
            self._wt = self.weight = None  # the float array was never written: no memory held
            return
        for off, p in parts:
            self.weight[off : off + p.shape[0]] = p.dequantize()

    def _put(self, param: str, value: np.ndarray) -> None:
        dst = getattr(self, param)
        if tuple(value.shape) != tuple(dst.shape):
            raise ShardingError(
                f"{type(self).__name__}.{param}: slice has shape {tuple(value.shape)}, expected {tuple(dst.shape)}"
            )
        dst[...] = self.xp.asarray(value, dtype=self.dtype)

    @staticmethod
    def _check_full(src: TensorSource, shape: tuple) -> None:
        if tuple(src.shape) != tuple(shape):
            raise ShardingError(f"{src.name}: checkpoint shape {tuple(src.shape)}, model expects {tuple(shape)}")

    def matmul(self, x):
        if self.qweight is not None:
            return _block_matmul()(x, self.qweight)
        return x @ self._wt

    def kernel(self):
        """``(f, rows)``: ``f(x, out)`` writes ``x @ W.T`` (no bias) into ``out`` for a 2-D
        C-contiguous float32 NumPy ``x`` of at most ``rows`` rows, bound once to this
        rank's weight (the decode step's loop, :mod:`mpitp.models.decode_step`)."""
        if self.qweight is not None:
            from ..kernels.matmul import bind

            return bind(self.qweight)
        wt = self._wt  # [B, 1, K] @ W.T as the generic forward multiplies: the same BLAS call
        return (lambda x, out: np.matmul(x[:, None], wt, out=out[:, None])), sys.maxsize


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""

    def weight_loader(self, param: str, src: TensorSource, shard_id: Any = None) -> None:
        full = getattr(self, param).shape
        self._check_full(src, full)
        if param == "weight" and (bw := self._blocks(src, rows=(0, full[0]))) is not None:
            self._parts[0] = bw
            return
        self._put(param, src.read())

    def __call__(self, x):
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias


class ColumnParallelLinear(LinearBase):
    """Rank r holds output rows ``[r*out/p, (r+1)*out/p)``; output stays sharded unless
    ``gather_output`` (then every rank gets the whole output, ranks in order)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = False,
        comm=None,
        gather_output: bool = False,
        sizes=None,
        dtype=np.float32,
        xp=np,
    ):
        p, r = (comm.size, comm.rank) if comm is not None else (1, 0)
        self.sizes = _cut(out_features, p, sizes, "output")
        self.start = partition.starts(self.sizes)[r]
        super().__init__(in_features, self.sizes[r], bias=bias, comm=comm, dtype=dtype, xp=xp)
        self.full_out = out_features
        self.gather_output = gather_output

    def weight_loader(self, param: str, src: TensorSource, shard_id: Any = None) -> None:
        full = (self.full_out, self.in_features) if param == "weight" else (self.full_out,)
        self._check_full(src, full)
        rows = (self.start, self.start + self.out_features)
        if param == "weight" and (bw := self._blocks(src, rows=rows)) is not None:
            self._parts[0] = bw
            return
        self._put(param, src.rows(*rows))

    def __call__(self, x):
        y = self.matmul(x)
        if self.bias is not None:
            y = y + self.bias
        if self.gather_output and self.tp_size > 1:
            y = gather_last_dim(self.comm, y, self.sizes)
        return y


class RowParallelLinear(LinearBase):
    """Rank r holds input columns ``[r*in/p, (r+1)*in/p)``; the partial outputs are
    all-reduced (``reduce_results``) and the bias is added once, after the reduction."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = False,
        comm=None,
        input_is_parallel: bool = True,
        reduce_results: bool = True,
        sizes=None,
        dtype=np.float32,
        xp=np,
    ):
        p, r = (comm.size, comm.rank) if comm is not None else (1, 0)
        self.sizes = _cut(in_features, p, sizes, "input")
        self.start = partition.starts(self.sizes)[r]
        super().__init__(self.sizes[r], out_features, bias=bias, comm=comm, dtype=dtype, xp=xp)
        self.full_in = in_features
        self.input_is_parallel, self.reduce_results = input_is_parallel, reduce_results

    def weight_loader(self, param: str, src: TensorSource, shard_id: Any = None) -> None:
        if param == "bias":
            self._check_full(src, (self.out_features,))
            self._put("bias", src.read())
            return
        self._check_full(src, (self.out_features, self.full_in))
        cols = (self.start, self.start + self.in_features)
        if (bw := self._blocks(src, cols=cols)) is not None:
            self._parts[0] = bw
            return
        self._put("weight", src.cols(*cols))

    def __call__(self, x):
        if not self.input_is_parallel:
            x = x[..., self.start : self.start + self.in_features]
        y = self.matmul(x)
        if self.reduce_results and self.tp_size > 1:
            self.comm.allreduce(y, out=y)
        return y if self.bias is None else y + self.bias


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one weight (gate_up_proj), each cut by its own
    per-rank sizes (``sizes``: one list for all outputs of equal length, e.g. the
    intermediate cut). Locally ``[gate_r ; up_r]``: shard k lands at the local row where
    the rank's shards before it end (with even cuts, ``sum(output_sizes[:k]) / p``)."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        *,
        bias: bool = False,
        comm=None,
        sizes=None,
        dtype=np.float32,
        xp=np,
    ):
        p, r = (comm.size, comm.rank) if comm is not None else (1, 0)
        self.output_sizes = list(output_sizes)
        self.cuts = [_cut(n, p, sizes, f"output_sizes[{k}]") for k, n in enumerate(output_sizes)]
        mine = [c[r] for c in self.cuts]
        self.shard_offsets = partition.starts(mine)
        self.shard_starts = [partition.starts(c)[r] for c in self.cuts]
        super().__init__(
            in_features,
            sum(output_sizes),
            bias=bias,
            comm=comm,
            sizes=[sum(c[q] for c in self.cuts) for q in range(p)],
            dtype=dtype,
            xp=xp,
        )

    def weight_loader(self, param: str, src: TensorSource, shard_id: int = 0) -> None:
        size = self.output_sizes[shard_id]
        self._check_full(src, (size, self.in_features) if param == "weight" else (size,))
        n, off, start = self.cuts[shard_id][self.tp_rank], self.shard_offsets[shard_id], self.shard_starts[shard_id]
        if param == "weight" and (bw := self._blocks(src, rows=(start, start + n))) is not None:
            self._parts[off] = bw
            return
        dst = getattr(self, param)
        dst[off : off + n] = self.xp.asarray(src.rows(start, start + n), dtype=self.dtype)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one weight, cut by whole KV-head groups
    (:func:`mpitp.tp.partition.attention`). Locally ``[Q_r | K_r | V_r]``: the rank's query
    heads, then its KV heads — its own share of them, or, with more ranks than KV heads,
    the one KV head its query heads use (replicated on the ranks that share it)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_heads: int,
        total_kv_heads: int,
        *,
        bias: bool = False,
        comm=None,
        split: partition.AttentionSplit | None = None,
        dtype=np.float32,
        xp=np,
    ):
        p, r = (comm.size, comm.rank) if comm is not None else (1, 0)
        self.split_plan = split or partition.attention(total_heads, total_kv_heads, p)
        self.num_heads, self.q_head_start, self.num_kv_heads, self.kv_start = self.split_plan.rank(r)
        self.total_heads, self.total_kv_heads, self.head_dim = total_heads, total_kv_heads, head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        local = [(q + 2 * k) * head_dim for q, k in zip(self.split_plan.q, self.split_plan.kv)]
        super().__init__(hidden_size, sum(local), bias=bias, comm=comm, sizes=local, dtype=dtype, xp=xp)
        self.full_out = (total_heads + 2 * total_kv_heads) * head_dim  # q, k, v as the checkpoint has them

    def weight_loader(self, param: str, src: TensorSource, shard_id: str = "q") -> None:
        d = self.head_dim
        if shard_id == "q":
            full, start, n, off = self.total_heads * d, self.q_head_start * d, self.q_size, 0
        else:
            full, start, n = self.total_kv_heads * d, self.kv_start * d, self.kv_size
            off = self.q_size + (0 if shard_id == "k" else self.kv_size)
        self._check_full(src, (full, self.in_features) if param == "weight" else (full,))
        if param == "weight" and (bw := self._blocks(src, rows=(start, start + n))) is not None:
            self._parts[off] = bw
            return
        dst = getattr(self, param)
        dst[off : off + n] = self.xp.asarray(src.rows(start, start + n), dtype=self.dtype)

    def split(self, qkv):
        q = qkv[..., : self.q_size]
        k = qkv[..., self.q_size : self.q_size + self.kv_size]
        v = qkv[..., self.q_size + self.kv_size :]
        return q, k, v


_BLOCK_MATMUL: Any = None


def _block_matmul():
    """The compiled kernels' entry, imported on first use (numba loads in ~0.5 s)."""
    global _BLOCK_MATMUL
    if _BLOCK_MATMUL is None:
        from ..kernels.matmul import matmul

        _BLOCK_MATMUL = matmul
    return _BLOCK_MATMUL


def gather_last_dim(comm, y, sizes=None):
    """All-gather a tensor sharded along its last dimension (ranks in order; ``sizes``
    per rank, default equal): :meth:`mpitp.comm.Communicator.allgather_columns`."""
    return comm.allgather_columns(y, sizes)
