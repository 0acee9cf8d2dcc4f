"""Packing the streamed weights into one buffer (mpitp.tp.arena), in one process."""

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from mpitp.models.llama import LlamaForCausalLM
from mpitp.tp import ColumnParallelLinear, RowParallelLinear
from mpitp.tp.arena import ALIGN, pack

FIX = Path(__file__).resolve().parent / "fixtures"


def test_pack_keeps_values_and_shares_one_buffer():
    a, b = ColumnParallelLinear(5, 7), RowParallelLinear(7, 3)
    rng = np.random.default_rng(0)
    wa, wb = rng.standard_normal((7, 5)).astype(np.float32), rng.standard_normal((3, 7)).astype(np.float32)
    a.weight[...] = wa
    b.weight[...] = wb
    arena = pack([a, b, a])  # a listed twice: packed once
    assert np.array_equal(a.weight, wa) and np.array_equal(b.weight, wb)
    for m in (a, b):
        assert np.shares_memory(m._wt, arena) and np.shares_memory(m.weight, arena)
        assert m.weight.base is not None and m._wt.ctypes.data % ALIGN == 0
    assert arena.size >= a._wt.size + b._wt.size
    x = rng.standard_normal((2, 5)).astype(np.float32)
    np.testing.assert_allclose(a(x), x @ wa.T, rtol=1e-6)


def test_pack_rejects_mixed_dtypes():
    with pytest.raises(ValueError, match="one dtype"):
        pack([ColumnParallelLinear(4, 4, dtype=np.float32), ColumnParallelLinear(4, 4, dtype=np.float64)])


@pytest.mark.parametrize("name", ["tied", "mha"])
def test_loaded_model_streams_from_one_buffer(name):
    """Every streamed weight of a loaded model is a view of the arena, holds the
    checkpoint's values, and a tied head still is the embedding."""
    model = LlamaForCausalLM.from_pretrained(FIX / name)
    arena = model._arena
    layer = model.layers[0]
    for mod in (
        layer.self_attn.qkv_proj,
        layer.self_attn.o_proj,
        layer.mlp.gate_up_proj,
        layer.mlp.down_proj,
        model.lm_head,
        model.embed_tokens,
    ):
        assert np.shares_memory(mod._wt, arena), type(mod).__name__
    ckpt = load_file(str(FIX / name / "model.safetensors"))
    np.testing.assert_array_equal(layer.mlp.down_proj.weight, ckpt["model.layers.0.mlp.down_proj.weight"])
    emb = ckpt["model.embed_tokens.weight"]
    np.testing.assert_array_equal(model.embed_tokens.weight[: emb.shape[0]], emb)
    if model.config.tie_word_embeddings:
        assert model.lm_head._wt is model.embed_tokens._wt
    else:
        np.testing.assert_array_equal(model.lm_head.weight[: emb.shape[0]], ckpt["lm_head.weight"])
