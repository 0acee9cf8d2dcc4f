"""Tensor-parallel LLaMA at the launcher's world size: Hugging Face parity on the
committed fixtures, equality with the single-process model, traffic per forward, and
clear load-time errors where the config cannot be cut this many ways (more ranks than
heads); every other world size, uneven ones included, must match Hugging Face."""

import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import agree, decode_both_ways, same_on_all_ranks
from mpi4py import MPI

import mpitp
from mpitp.models.llama import LlamaForCausalLM
from mpitp.tp import ShardingError

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


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "qwen2_moe", "olmoe"])
def test_qwen3_and_experts_in_the_decode_loop(tp, name):
    """Qwen3's per-head q/k norms, OLMoE's over the whole projection (all-reduced) and
    mixture-of-experts blocks run in the bound decode loop (its own steps, not the fused
    halves): the generic layers' logits bit for bit."""
    if N > 4 and name != "qwen3":
        return  # 4 attention heads: refused at this size (test_mixture_of_experts_parity)
    model = LlamaForCausalLM.from_pretrained(FIX / name, comm=tp)
    loop = model._decode_layers()
    agree(loop is not None and all(p is None for p in loop.plans), f"{name}: no loop, or a fused half")
    fast, generic, ran = decode_both_ways(model, [[5, 17, 42, 7, 3], [9, 2], [11, 12, 13]])
    agree(ran and np.array_equal(fast, generic), f"{name}: decode loop differs from the generic layers")


MOE = ["qwen3_moe", "qwen2_moe", "olmoe"]  # 5 experts top-3 renormalized; 7 top-2, a shared expert and
# dense layers; 6 top-2, q/k normed over the whole projection (one more all-reduce a layer)


@pytest.mark.parametrize("moe", ["ep", "tp"])
@pytest.mark.parametrize("name", MOE)
def test_mixture_of_experts_parity(tp, name, moe):
    """Qwen3-MoE, Qwen2-MoE and OLMoE made by transformers, experts cut both ways over N ranks
    (ep: whole experts, 5, 7 or 6 over any N, uneven; tp: every expert's columns): logits
    within 1e-4 of transformers', its greedy tokens, every rank routing alike, one all-reduce
    per MoE block (as the dense MLP's; OLMoE's q/k norms one more, of 2 floats a row), and
    each rank reading only its share of the experts."""
    ref = np.load(FIX / name / "reference.npz")
    if N > 4:  # 4 attention heads: refused at load, with the numbers
        with pytest.raises(ShardingError, match="exceeds the number of attention heads = 4"):
            LlamaForCausalLM.from_pretrained(FIX / name, comm=tp, moe=moe)
        return
    model = LlamaForCausalLM.from_pretrained(FIX / name, comm=tp, moe=moe)
    tp.traffic.reset()
    logits = model(ref["input_ids"])
    diff = float(np.abs(logits - ref["logits"]).max())
    agree(diff <= 1e-4, f"{name} --moe {moe}: max |logit - HF| = {diff:.2e} at {N} ranks")
    layers = model.config.num_hidden_layers
    whole = model.config.qk_norm_whole  # OLMoE: each row's sums of squares of q and k
    want = 0 if N == 1 else (3 if whole else 2) * layers + 1
    agree(tp.traffic.calls.get("allreduce", 0) == want, f"{dict(tp.traffic.calls)}: want {want} all-reduces")
    moes = [L.mlp for L in model.layers if hasattr(L.mlp, "experts")]
    sparse = [i for i in range(layers) if model.config.sparse(i)]  # qwen2_moe: layer 1 of 4 (step 2, 3 dense)
    agree(len(moes) == len(sparse) == (1 if name == "qwen2_moe" else layers), f"{len(moes)} MoE blocks")
    if whole:  # each rank its heads' slice of the norms' weights; with 2 KV heads over 3-4 ranks, shared
        a = model.layers[0].self_attn
        held = [(n, start) for n, start, own in tp.mpi.allgather((a.nkv, a.k_norm.start, a.k_counts)) if own]
        kv, d = model.config.num_key_value_heads, model.config.head_dim
        agree(
            sorted(s for _, s in held) == [d * i for i in range(kv)][: len(held)] and sum(n for n, _ in held) == kv,
            f"k's norm counts the KV heads (count, start) {held}, not each of {kv} once",
        )
    agree(same_on_all_ranks(moes[0].last_routes[0]), "ranks routed tokens differently")
    prompts = [ref["greedy_0"][:9].tolist(), ref["greedy_1"][:6].tolist()]
    out = model.generate(prompts, max_new_tokens=10, stop_tokens=[])
    agree(out == [ref["greedy_0"].tolist(), ref["greedy_1"].tolist()], f"{name} --moe {moe}: greedy differs from HF")
    c = model.config
    expert = 3 * c.hidden_size * c.moe_intermediate_size * 4  # one expert's bytes
    held = sum(m.weight.size for m in moes[0].experts.values() for m in (m.gate_up_proj, m.down_proj)) * 4
    agree(tp.mpi.allreduce(held) == c.num_experts * expert, f"experts held {held} per rank do not add up")
    total = (FIX / name / "model.safetensors").stat().st_size
    others = total - len(moes) * c.num_experts * expert  # attention, norms, dense MLP, router, shared expert
    read = model.load_info["bytes_read"]
    agree(read <= others + len(moes) * held + 4096, f"rank read {read} bytes; others {others} + its experts {held}")


@pytest.mark.parametrize("name", MOE)
def test_data_parallel_attention_with_experts_over_all_to_all(tp, name):
    """--dp-attention: each rank decodes its own prompts (different on every rank), the
    experts cut ep over the N ranks and reached by all-to-all: every rank's logits equal the
    single-process model's on its prompts within 1e-5 and its greedy tokens are the same; the
    all-to-all counters equal, to the byte, what the routes ask (each row once to every other
    rank holding one of its experts, H + 2k floats, and its sum back, H floats) and what the
    vocabulary-cut head sends (the rows all-gathered, the logits' blocks to their rows' ranks); a rank with
    no rows in a step still takes part (no hang) while the others get their answers."""
    from mpitp.models.moe import dispatch_rows

    single = LlamaForCausalLM.from_pretrained(FIX / name, comm=None)
    dp = LlamaForCausalLM.from_pretrained(FIX / name, comm=tp, dp_attention=True)
    r = tp.rank
    ids = (np.arange(6 + r)[None] * (r + 3) + 5 * r) % 250  # a prompt of its own length on each rank
    tp.traffic.reset()
    a, b = dp(ids), single(ids)
    diff = float(np.abs(a - b).max())
    agree(diff <= 1e-5, f"{name} --dp-attention at {N} ranks: max |logit - one process| = {diff:.2e}")
    c, H = dp.config, dp.config.hidden_size
    got, want = tp.traffic.by_collective.get("alltoallv", 0), 0
    for L in dp.layers:
        if hasattr(L.mlp, "experts"):
            _, counts, _ = dispatch_rows(L.mlp.owner[L.mlp.last_routes[0]], N)
            every = tp.mpi.allgather(counts)  # every rank's counts: what came here from the others
            out = sum(counts) - counts[r]
            back = sum(every[q][r] for q in range(N) if q != r)
            want += out * (H + 2 * c.num_experts_per_tok) * 4 + back * H * 4
    # the head (:mod:`mpitp.tp.dp_head`): every rank's rows all-gathered (x and 5 more floats), each
    # rank's (max, token, mass) of every row back, and, as logits are asked here, its block of
    # each other rank's rows to that rank (padded to the widest block)
    rows = tp.mpi.allgather(ids.size)
    head = dp.lm_head
    want += (sum(rows) - rows[r]) * max(head.sizes) * 4
    gathered = tp.traffic.by_collective.get("allgather", 0)
    agree(
        gathered == (rows[r] * (H + 5) * 4 + sum(rows) * 24 if N > 1 else 0),
        f"{name}: the head's all-gathers counted {gathered}",
    )
    agree(head.per_rank < c.vocab_size or N == 1, f"{name}: the head is not cut ({head.per_rank} rows)")
    agree(got == want, f"{name}: alltoallv counted {got} bytes, the routes ask {want}")
    prompts = [ids[0].tolist(), ids[0][:4].tolist()]
    agree(
        dp.generate(prompts, max_new_tokens=6, stop_tokens=[])
        == single.generate(prompts, max_new_tokens=6, stop_tokens=[]),
        f"{name} --dp-attention: greedy tokens differ from one process",
    )
    moe = next(L.mlp for L in dp.layers if hasattr(L.mlp, "experts"))
    x = np.random.default_rng(r).standard_normal((0 if r == 0 else 3, H)).astype(np.float32)
    y = moe(x)  # rank 0 sends nothing and receives the others' rows
    ref = next(L.mlp for L in single.layers if hasattr(L.mlp, "experts"))(x)
    agree(y.shape == x.shape and np.allclose(y, ref, atol=1e-5), "a step where rank 0 has no rows")


def _broken_experts(root: Path) -> None:
    """Two copies of qwen3_moe: one without expert 4's up_proj of layer 2, one whose expert
    0 down_proj of layer 0 is transposed."""
    from safetensors.numpy import load_file, save_file

    w = load_file(FIX / "qwen3_moe" / "model.safetensors")
    for name, change in (("missing", "model.layers.2.mlp.experts.4.up_proj.weight"), ("shape", None)):
        d = root / name
        d.mkdir()
        shutil.copy(FIX / "qwen3_moe" / "config.json", d)
        v = dict(w)
        if change:
            del v[change]
        else:
            t = "model.layers.0.mlp.experts.0.down_proj.weight"
            v[t] = np.ascontiguousarray(np.concatenate([v[t], v[t]], axis=1))
        save_file(v, d / "model.safetensors")


@pytest.mark.parametrize("moe", ["ep", "tp"])
def test_broken_experts_fail_on_every_rank(tp, moe):
    """A missing or mis-shaped expert tensor fails the load on every rank (not only the one
    that holds that expert), naming the tensor and the shapes."""
    from helpers import shared_dir

    from mpitp.models.loader import CheckpointError

    if N > 4:  # 4 attention heads: the cut is refused before any tensor is read
        with pytest.raises(ShardingError, match="attention heads = 4"):
            LlamaForCausalLM.from_pretrained(FIX / "qwen3_moe", comm=tp, moe=moe)
        return
    with shared_dir("mpitp-moe-", _broken_experts) as root:
        for name, text in (("missing", "experts.4.up_proj"), ("shape", r"\(64, 128\).*\(64, 64\)")):
            with pytest.raises(CheckpointError, match=text):
                LlamaForCausalLM.from_pretrained(root / name, comm=tp, moe=moe)


def test_decoding_agrees_on_every_rank(tp):
    """Greedy decoding sends no token message and gathers no logits (each rank's argmax of
    its shard of the vocabulary, one all-gather of a (value, token) pair a step: 16 bytes);
    sampling gathers the logits, draws on rank 0 and broadcasts, even when the ranks'
    generators would disagree."""
    model = LlamaForCausalLM.from_pretrained(FIX / "mha", comm=tp)
    prompt = [[5, 17, 42]]
    greedy = model.generate(prompt, max_new_tokens=6, stop_tokens=[])
    tp.traffic.reset()
    again = model.generate(prompt, max_new_tokens=6, stop_tokens=[])
    agree(greedy == again and same_on_all_ranks(np.array(greedy)), "greedy tokens differ between ranks or runs")
    agree(tp.traffic.calls.get("broadcast", 0) == 0, "greedy decoding broadcast tokens")
    gathered = tp.traffic.by_collective.get("allgather", 0)
    agree(gathered == (6 * 16 if N > 1 else 0), f"greedy decoding all-gathered {gathered} bytes, want 6 x 16")
    tp.traffic.reset()
    sampled = model.generate(prompt, max_new_tokens=6, stop_tokens=[], temperature=1.0, seed=1000 + tp.rank)
    agree(same_on_all_ranks(np.array(sampled)), "sampled tokens differ between ranks")
    agree(tp.traffic.calls.get("broadcast", 0) == (6 if N > 1 else 0), f"broadcasts {dict(tp.traffic.calls)}")
    logits = 6 * model.lm_head.per_rank * 4  # each step's row of this rank's shard
    gathered = tp.traffic.by_collective.get("allgather", 0)
    agree(gathered == (logits if N > 1 else 0), f"sampling all-gathered {gathered} bytes, want {logits}")


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
