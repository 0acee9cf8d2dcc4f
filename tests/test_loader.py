"""Checkpoint loading in one process: both config styles, and errors that name the
tensor or config field and the numbers."""

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from mpitp.models.config import ConfigError, LlamaConfig
from mpitp.models.llama import LlamaForCausalLM
from mpitp.models.loader import CheckpointError
from mpitp.models.rope import inv_frequencies
from mpitp.tp import ShardingError

FIX = Path(__file__).resolve().parent / "fixtures"


def copy(name, tmp_path) -> Path:
    dst = tmp_path / name
    shutil.copytree(FIX / name, dst)
    return dst


def edit_config(path: Path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def test_transformers4_config_style_gives_the_same_model(tmp_path):
    d = copy("llama3_rope", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope  # transformers 4: rope_scaling at top level
    (d / "config.json").write_text(json.dumps(cfg))
    ref = np.load(FIX / "llama3_rope" / "reference.npz")
    logits = LlamaForCausalLM.from_pretrained(d)(ref["input_ids"])
    assert np.abs(logits - ref["logits"]).max() <= 1e-4


def test_llama3_scaling_changes_long_wavelengths_only():
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    plain, scaled = inv_frequencies(8, 500000.0, {}), inv_frequencies(8, 500000.0, scaling)
    assert scaled[0] != plain[0] or 2 * np.pi / plain[0] < 4  # short wavelengths kept
    assert np.allclose(scaled[-1], plain[-1] / 8)  # long ones divided by factor


def test_missing_tensor_is_named(tmp_path):
    d = copy("mha", tmp_path)
    w = load_file(str(d / "model.safetensors"))
    del w["model.layers.1.mlp.up_proj.weight"]
    save_file(w, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensors model\.layers\.1\.mlp\.up_proj\.weight"):
        LlamaForCausalLM.from_pretrained(d)


def test_untied_checkpoint_without_lm_head_fails_loudly(tmp_path):
    d = copy("mha", tmp_path)
    w = load_file(str(d / "model.safetensors"))
    del w["lm_head.weight"]
    save_file(w, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="does not tie word embeddings"):
        LlamaForCausalLM.from_pretrained(d)


def test_tied_checkpoint_that_still_carries_lm_head_loads(tmp_path):
    d = copy("tied", tmp_path)
    w = load_file(str(d / "model.safetensors"))
    w["lm_head.weight"] = w["model.embed_tokens.weight"].copy()
    save_file(w, str(d / "model.safetensors"))
    ref = np.load(FIX / "tied" / "reference.npz")
    assert np.abs(LlamaForCausalLM.from_pretrained(d)(ref["input_ids"]) - ref["logits"]).max() <= 1e-4


def test_shape_mismatch_names_tensor_and_numbers(tmp_path):
    d = copy("mha", tmp_path)
    edit_config(d, intermediate_size=96)
    with pytest.raises(
        ShardingError,
        match=r"mlp\.(gate|up|down)_proj\.weight: checkpoint shape \((192, 96|96, 192)\), model expects \(96, 96\)",
    ):
        LlamaForCausalLM.from_pretrained(d)


def test_unknown_architecture_and_missing_field(tmp_path):
    d = copy("mha", tmp_path)
    edit_config(d, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ConfigError, match="unknown architecture"):
        LlamaForCausalLM.from_pretrained(d)
    edit_config(d, architectures=["LlamaForCausalLM"], hidden_size=None)
    with pytest.raises(ConfigError, match="'hidden_size'"):
        LlamaConfig.from_path(d)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="nothing: no such directory"):
        LlamaForCausalLM.from_pretrained(tmp_path / "nothing")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        LlamaForCausalLM.from_pretrained(tmp_path / "afile")
    (tmp_path / "config.json").write_text((FIX / "mha" / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        LlamaForCausalLM.from_pretrained(tmp_path)


def test_qwen2_gets_qkv_bias():
    cfg = LlamaConfig.from_path(FIX / "qwen2")
    assert cfg.qkv_bias and not cfg.o_bias and cfg.architecture == "Qwen2ForCausalLM"


@pytest.mark.parametrize("name", ["mha", "gqa", "tied", "qwen2", "llama3_rope"])
def test_weight_map_names_exactly_the_checkpoint_tensors(name):
    """The model's one weight map (named_weights) lists every tensor transformers saved for
    that config, and nothing else (a tied head: no lm_head.weight)."""
    from safetensors import safe_open

    path = FIX / name
    saved = set()
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="numpy") as h:
            saved |= set(h.keys())
    saved -= {n for n in saved if n.endswith("rotary_emb.inv_freq")}
    model = LlamaForCausalLM(LlamaConfig.from_path(path))
    names = [n for n, *_ in model.named_weights()]
    assert len(names) == len(set(names))
    assert set(names) == saved
    tied = model.config.tie_word_embeddings
    assert ("lm_head.weight" in saved) == (not tied)


def test_gguf_tensor_table_equals_gguf_readers(tmp_path):
    """mpitp's tensor-table reader (which skips the metadata's values by their lengths)
    gives every tensor as gguf.GGUFReader does: name, type, shape, dtype and bytes; with a
    vocabulary of strings and other arrays before the tensors, a non-default alignment, and
    native and quantized types. A file cut anywhere raises."""
    import gguf

    from mpitp.models.gguf_tensors import read_tensors

    rng = np.random.default_rng(0)
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    w.add_token_list([f"tok{i}" * (i % 7) for i in range(3000)])  # strings of 0..~30 bytes
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(3000)])
    w.add_array("some.nested", [[1, 2], [3]])
    w.add_string("general.name", "t")
    w.add_float32("x.f", 1.5)
    w.add_bool("x.b", True)
    w.add_tensor("a.weight", rng.standard_normal((5, 96)).astype(np.float32))
    w.add_tensor("b.weight", rng.standard_normal((3, 64)).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("c.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("d.weight", rng.integers(0, 9, 7).astype(np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    mine, theirs = read_tensors(path), gguf.GGUFReader(str(path)).tensors
    assert [t.name for t in mine] == [t.name for t in theirs] == ["a.weight", "b.weight", "c.weight", "d.weight"]
    for a, b in zip(mine, theirs):
        assert a.type_name == b.tensor_type.name and a.shape == tuple(int(d) for d in b.shape)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data)
    data = path.read_bytes()
    last = theirs[-1].data_offset + 1  # inside the last tensor's bytes
    for cut in (3, 23, 200, len(data) // 3, last):  # header, metadata, tensor infos, data
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises((ValueError, struct.error)):
            read_tensors(tmp_path / "cut.gguf")


def _tiny_moe(tmp_path, monkeypatch) -> Path:
    """A small shape of ``mpitp bench decode --shape qwen3-30b-a3b``'s kind, Q4_K_M: written
    to tmp_path/tiny.gguf and imported; the imported model's directory."""
    from mpitp.bench import shapes
    from mpitp.models.gguf_import import convert

    small = dict(arch="qwen3moe", hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, ffn=512, experts=5,
                 used=2, expert_ffn=256, rope_theta=1e6, vocab=49216)  # fmt: skip
    monkeypatch.setitem(shapes.SHAPES, "tiny-moe", small)
    shapes.write("tiny-moe", "q4_k_m", tmp_path / "tiny.gguf", say=lambda *a: None)
    return convert(tmp_path / "tiny.gguf", tmp_path / "tiny")


def test_bench_shape_writes_a_mixture_of_experts_file_mpitp_reads(tmp_path, monkeypatch):
    """``mpitp bench decode --shape qwen3-30b-a3b`` writes llama.cpp's qwen3moe layout (stacked
    ffn_*_exps, a float32 router, q/k norms, the vocabulary padded with unused tokens); here a
    small shape of the same kind, Q4_K_M: mpitp imports it, holds its blocks as Q4_K/Q6_K,
    and every expert's rows equal the gguf package's dequantization of the stacked tensor."""
    import gguf

    from mpitp.models.llama import LlamaForCausalLM

    f = tmp_path / "tiny.gguf"
    d = _tiny_moe(tmp_path, monkeypatch)
    m = LlamaForCausalLM.from_pretrained(d, activations="float32")
    c = m.config
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.vocab_size) == (5, 2, 256, 49216)
    assert c.qk_norm and c.norm_topk_prob and {"Q4_K", "Q6_K"} <= set(m.weight_formats())
    floats = LlamaForCausalLM.from_pretrained(d, weights="float32")
    t = next(t for t in gguf.GGUFReader(str(f)).tensors if t.name == "blk.1.ffn_down_exps.weight")
    full = gguf.quants.dequantize(t.data, t.tensor_type).reshape(5, 256, 256)
    for e, expert in floats.layers[1].mlp.experts.items():
        assert np.array_equal(expert.down_proj.weight, full[e])
    ids = np.arange(1, 9)[None]
    a, b = m(ids), floats(ids)
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()


def test_expert_cuts_and_the_auto_choice():
    """ep over more ranks than experts is refused with the numbers; ep cuts any count over
    any ranks (128 over 3: 43, 43, 42); tp cuts each expert's columns in whole blocks; auto
    takes the cut whose slowest rank reads fewer expert weights a step: on Qwen3-30B-A3B's
    shape at 2 ranks tp, both where blocks of 32 split it evenly and where K-quant
    super-blocks leave a 512/256 column split (turned from expert to expert: MoEPlan.cut)."""
    import dataclasses

    from mpitp.models.moe import MoEPlan, choose

    c = LlamaConfig.from_path(FIX / "qwen3_moe")
    with pytest.raises(ShardingError, match="6 ranks but 5 experts"):
        MoEPlan.of(c, 6, "ep")
    big = dataclasses.replace(c, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, hidden_size=2048)
    assert MoEPlan.of(big, 3, "ep").experts == [43, 43, 42]
    assert list(MoEPlan.of(big, 3, "ep").held(2)) == list(range(86, 128))
    assert MoEPlan.of(big, 2, "tp", 256).columns == [512, 256]
    assert (choose(big, 2, 256), choose(big, 2, 32), choose(big, 1), choose(c, 6)) == ("tp", "tp", "ep", "tp")


BUILT_ARRAYS = """
import sys
import numpy as np
from mpitp.models import loader
from mpitp.models.llama import LlamaForCausalLM

def in_heap(a):
    heap = [[int(r, 16) for r in l.split()[0].split("-")] for l in open("/proc/self/maps") if "[heap]" in l]
    return int(any(lo <= a.ctypes.data < hi for lo, hi in heap))

where = []
def load_weights(model, path, _real=loader.load_weights):  # called once the model is built
    big = [m._wt for _, m in model.named_modules() if getattr(m, "_wt", None) is not None and m._wt.nbytes >= 256 << 10]
    where.append((len(big), sum(map(in_heap, big))))
    return _real(model, path)
loader.load_weights = load_weights
x = np.ones(20 << 20, np.uint8)
del x  # a big free, as imports and an earlier load make: glibc's mmap threshold grows to 20 MiB
m = LlamaForCausalLM.from_pretrained(sys.argv[1])
t = np.empty(4 << 20, np.uint8)  # a forward's temporary, after the load
print(*where[0], in_heap(t))
"""


def test_a_models_arrays_are_mapped_and_later_temporaries_come_from_the_heap(tmp_path, monkeypatch):
    """A model is built with zero-filled arrays that its block weights replace, never written:
    calloc's fresh pages, no memory until touched. Once glibc's mmap threshold had grown (a
    big free), they came from the heap instead; freed there, a later build's calloc cleared
    the reused chunks page by page: after a --moe tp load of the 12-layer Qwen3-30B-A3B
    file, a --dp-attention load in the same process peaked at 11.6 GB of anonymous memory a
    rank against 4.0 alone, and benchmarks/moe_layouts.py ran out of memory. The loader fixes
    the threshold before it builds the model: its big arrays are their own mappings. After
    the load it raises it again: a forward's temporaries (a 512-token prefill's, several MB)
    then come from the heap and are reused, not mapped, faulted in and unmapped each time
    (Qwen3-0.6B's prefill of 512 on AVX2 took 3.1 s that way against 2.5)."""
    import subprocess
    import sys

    d = _tiny_moe(tmp_path, monkeypatch)
    out = subprocess.run([sys.executable, "-c", BUILT_ARRAYS, str(d)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    big, in_heap, temporary_in_heap = map(int, out.stdout.split()[-3:])
    # every expert's gate_up and down at least; a chunk the imports freed into the heap may still
    # serve one (glibc looks in its free lists before it maps): 1 of 26 here, 24 of 26 before
    assert big >= 2 * 5 * 2 and in_heap <= big // 8, (big, in_heap)
    assert temporary_in_heap == 1
