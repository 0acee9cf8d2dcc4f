"""Tensor-parallel LLaMA at the launcher's world size: Hugging Face parity on the
committed fixtures, equality with the single-process model, traffic per forward, and
clear load-time errors where the config cannot be cut this many ways (more ranks than
heads); every other world size, uneven ones included, must match Hugging Face."""

from pathlib import Path

import numpy as np
import pytest
from helpers import agree, decode_both_ways, same_on_all_ranks
from mpi4py import MPI

import mpitp
from mpitp.models.llama import LlamaForCausalLM

N = MPI.COMM_WORLD.size
FIX = Path(__file__).resolve().parent.parent / "fixtures"
NAMES = [
    "mha",
    "gqa",
    "tied",
    "llama3_rope",
    "bf16",
    "sharded",
    "qwen2",
    "qwen3",
]  # qwen3: q/k norms, head_dim 32 of 64


@pytest.fixture(scope="module")
def tp():
    c = mpitp.Communicator()
    yield c
    c.free()


@pytest.mark.parametrize("name", NAMES)
def test_huggingface_parity(tp, name):
    ref = np.load(FIX / name / "reference.npz")
    model = LlamaForCausalLM.from_pretrained(FIX / name, comm=tp)
    logits = model(ref["input_ids"])
    diff = float(np.abs(logits - ref["logits"]).max())
    agree(diff <= 1e-4, f"{name}: max |logit - HF| = {diff:.2e} at TP={N}")
    prompts = [ref["greedy_0"][:9].tolist(), ref["greedy_1"][:6].tolist()]  # ragged batch
    out = model.generate(prompts, max_new_tokens=10, stop_tokens=[])
    agree(out == [ref["greedy_0"].tolist(), ref["greedy_1"].tolist()], f"{name}: greedy tokens differ from HF")


@pytest.mark.parametrize("name", ["gqa", "qwen2", "tied"])
def test_decode_loop_equals_the_generic_layers(tp, name):
    """A decode step through the bound loop gives the generic layers' logits bit for bit
    (float32 weights; qwen2 has q/k/v biases; a left-padded ragged batch masks columns)."""
    model = LlamaForCausalLM.from_pretrained(FIX / name, comm=tp)
    fast, generic, ran = decode_both_ways(model, [[5, 17, 42, 7, 3], [9, 2], [11, 12, 13]])
    agree(ran, f"{name}: the decode loop did not run")
    agree(np.array_equal(fast, generic), f"{name}: loop vs generic max diff {float(np.abs(fast - generic).max()):.2e}")


def test_qwen3_decodes_through_the_generic_layers(tp):
    """Qwen3's per-head q/k norms are not in the fused decode loop: its decode steps take the
    generic layers (the Hugging Face parity above covers them), never the loop."""
    model = LlamaForCausalLM.from_pretrained(FIX / "qwen3", comm=tp)
    agree(model.config.qk_norm and model._decode_layers() is None, "qwen3: a decode loop was built")
    fast, generic, ran = decode_both_ways(model, [[5, 17, 42, 7, 3], [9, 2]])
    agree(not ran and np.array_equal(fast, generic), "qwen3: decode step differs from the generic layers")


def test_decoding_agrees_on_every_rank(tp):
    """Greedy decoding sends no token message (every rank has the same logits); sampling
    draws on rank 0 and broadcasts, even when the ranks' generators would disagree."""
    model = LlamaForCausalLM.from_pretrained(FIX / "mha", comm=tp)
    prompt = [[5, 17, 42]]
    greedy = model.generate(prompt, max_new_tokens=6, stop_tokens=[])
    tp.traffic.reset()
    again = model.generate(prompt, max_new_tokens=6, stop_tokens=[])
    agree(greedy == again and same_on_all_ranks(np.array(greedy)), "greedy tokens differ between ranks or runs")
    agree(tp.traffic.calls.get("broadcast", 0) == 0, "greedy decoding broadcast tokens")
    sampled = model.generate(prompt, max_new_tokens=6, stop_tokens=[], temperature=1.0, seed=1000 + tp.rank)
    agree(same_on_all_ranks(np.array(sampled)), "sampled tokens differ between ranks")
    agree(tp.traffic.calls.get("broadcast", 0) == (6 if N > 1 else 0), f"broadcasts {dict(tp.traffic.calls)}")


@pytest.mark.parametrize("name", ["mha", "tied", "llama3_rope"])
def test_equals_single_process_model(tp, name):
    ids = np.load(FIX / name / "reference.npz")["input_ids"]
    full = LlamaForCausalLM.from_pretrained(FIX / name, comm=None)(ids)
    mine = LlamaForCausalLM.from_pretrained(FIX / name, comm=tp)(ids)
    diff = float(np.abs(full - mine).max())
    agree(diff <= 1e-5, f"{name}: TP={N} vs TP=1 max diff {diff:.2e}")


def test_two_allreduces_per_layer(tp):
    model = LlamaForCausalLM.from_pretrained(FIX / "mha", comm=tp)
    tp.traffic.reset()
    model(np.arange(9)[None] % 250)
    layers = model.config.num_hidden_layers
    want = 0 if N == 1 else 2 * layers + 1  # + the embedding's
    agree(tp.traffic.calls["allreduce"] == want, f"{tp.traffic.calls['allreduce']} all-reduces, want {want}")
    agree(tp.traffic.calls["allgather"] == (0 if N == 1 else 1), "one all-gather of logits in the head")


def test_each_rank_reads_its_slices(tp):
    model = LlamaForCausalLM.from_pretrained(FIX / "mha", comm=tp)
    total = (FIX / "mha" / "model.safetensors").stat().st_size
    read = model.load_info["bytes_read"]
    c = model.config
    norms = (2 * c.num_hidden_layers + 1) * c.hidden_size * 4  # replicated on every rank
    vocab = 2 * c.vocab_size * c.hidden_size * 4  # embedding + head, in blocks
    block = 2 * model.embed_tokens.per_rank * c.hidden_size * 4  # of the padded vocabulary
    mine = 4 * sum(m.weight.size for _, m in model.named_modules() if hasattr(m, "in_features"))  # its cut
    bound = mine + norms + block + 4096
    agree(read <= bound, f"rank read {read} of {total} bytes at TP={N} (its cut: {bound:.0f})")
    share = 1.5 * (total - vocab - norms) / N + norms + block + 4096  # heads fall unevenly, the MLP evenly
    agree(N == 1 or read <= share, f"rank read {read} of {total} bytes at TP={N} (share {share:.0f})")


def test_weight_bytes_per_rank(tp):
    model = LlamaForCausalLM.from_pretrained(FIX / "tied", comm=tp)
    single = LlamaForCausalLM.from_pretrained(FIX / "tied", comm=None)
    per_rank = tp.mpi.allgather(model.weight_bytes())
    agree(
        sum(per_rank) >= single.weight_bytes() and max(per_rank) <= single.weight_bytes() / N + 64 * 1024,
        f"weights per rank {per_rank}, single {single.weight_bytes()}",
    )


def test_out_of_vocabulary_id_is_refused(tp):
    model = LlamaForCausalLM.from_pretrained(FIX / "gqa", comm=tp)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model([[1, 2, model.config.vocab_size]])
