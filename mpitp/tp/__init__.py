"""Tensor-parallel layers: how a weight is cut, and what each rank holds afterwards."""

from .embedding import ParallelLMHead, VocabParallelEmbedding
from .linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    ShardingError,
)
from .partition import AttentionSplit
from .source import ArraySource, SafetensorsSource, TensorSource

__all__ = [
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "ReplicatedLinear",
    "RowParallelLinear",
    "ShardingError",
    "VocabParallelEmbedding",
    "ParallelLMHead",
    "ArraySource",
    "SafetensorsSource",
    "TensorSource",
    "AttentionSplit",
]
