"""Pipeline stages (``pp``) with tensor parallelism inside each, at the launcher's world
size, against the same model on one rank (TP = 1, itself checked against transformers in
test_llama.py): every pp that divides the world (pp ≥ 2), on a 5-layer model (a layer
count no pp > 1 divides; hidden size 65, so a batch of 3 rows' hidden states does not
divide over a stage's T ranks: the last rank's 1/T is padded) and on a Q4_K_M file with
int8 activations. The last stage's
logits equal TP = 1's within 1e-5 of their scale (tensor parallelism changes only the
summation order; 1e-3 with int8 activations, where it can move a rounding), greedy and
seeded sampled tokens are the same, each stage holds only its layers, and a decode step
sends exactly one hidden state per row across each boundary (each of the T ranks its
1/T) and the tokens back. A pp that does not divide the world or exceeds the layers is
refused on every rank."""

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import agree, shared_dir
from mpi4py import MPI

import mpitp
from mpitp.models.llama import LlamaForCausalLM
from mpitp.models.pipeline import PipelineError

N = MPI.COMM_WORLD.size
PPS = [p for p in range(2, N + 1) if N % p == 0]
CFG = dict(hidden_size=65, intermediate_size=160, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
           num_hidden_layers=5, vocab_size=256, tie_word_embeddings=False)  # fmt: skip


def _write_random(out: Path) -> None:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(3)
    c = CFG
    H, I, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    t = {"model.embed_tokens.weight": rng.standard_normal((c["vocab_size"], H)), "model.norm.weight": np.ones(H)}
    t["lm_head.weight"] = rng.standard_normal((c["vocab_size"], H)) * 0.2
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (q, H)), ("self_attn.k_proj", (kv, H)), ("self_attn.v_proj", (kv, H)),
                            ("self_attn.o_proj", (H, q)), ("mlp.gate_proj", (I, H)), ("mlp.up_proj", (I, H)),
                            ("mlp.down_proj", (H, I))):  # fmt: skip
            t[p + name + ".weight"] = rng.standard_normal(shape) * 0.15
        t[p + "input_layernorm.weight"] = t[p + "post_attention_layernorm.weight"] = np.ones(H)
    save_file({k: np.asarray(v, np.float32) for k, v in t.items()}, str(out / "model.safetensors"))
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, **c}  # fmt: skip
    (out / "config.json").write_text(json.dumps(cfg))


def _write_both(root: Path) -> None:
    from gguf_files import write_q4_k_m

    (root / "deep").mkdir()
    _write_random(root / "deep")
    write_q4_k_m(root / "Q4_K_M")


@pytest.fixture(scope="module")
def models():
    with shared_dir("mpitp-pp-", _write_both) as root:
        yield root


@pytest.fixture(scope="module")
def world():
    c = mpitp.Communicator()
    yield c
    c.free()


@pytest.mark.parametrize("name,activations", [("deep", None), ("Q4_K_M", "int8x2")])
def test_stages_equal_one_rank(world, models, name, activations):
    if not PPS:
        pytest.skip(f"no pp >= 2 divides {N} rank(s)")
    path = models / name
    one = LlamaForCausalLM.from_pretrained(path, activations=activations)
    ids = np.random.default_rng(1).integers(0, 256, (3, 9))  # 3 x 9 x 65 values: no T > 1 divides them
    prompts = [[5, 17, 42, 7, 9], [9, 2, 4], [11, 3]]
    want = one(ids)
    greedy = one.generate(prompts, max_new_tokens=6, stop_tokens=[])
    sampled = one.generate(prompts, max_new_tokens=6, stop_tokens=[], temperature=0.9, top_k=40, seed=4)
    layers = one.config.num_hidden_layers
    for pp in [p for p in PPS if p <= layers]:  # the Q4_K_M file has 2 layers
        m = LlamaForCausalLM.from_pretrained(path, comm=world, pp=pp, activations=activations)
        st = m.stage
        agree(st.count == pp and st.tp.size == N // pp, f"pp={pp}: stage {st.index}/{st.count}, tp {st.tp.size}")
        agree(len(m.layers) == st.layers[1] - st.layers[0], f"pp={pp}: stage {st.index} holds {len(m.layers)} layers")
        bounds = world.allgather_object(st.layers)
        agree(bounds[0][0] == 0 and bounds[-1][1] == layers, f"pp={pp}: stages {bounds}")
        got = m(ids)
        if m.is_last:
            rel = float(np.abs(got - want).max() / np.abs(want).max())
            tol = 1e-5 if activations is None else 1e-3  # int8: a summation-order change can move a rounding
            agree(rel <= tol, f"{name} pp={pp} tp={N // pp}: logits {rel:.1e} from TP=1's")
        else:
            agree(got is None, f"pp={pp}: stage {st.index} returned logits")
        agree(m.generate(prompts, max_new_tokens=6, stop_tokens=[]) == greedy, f"{name} pp={pp}: greedy tokens")
        s = m.generate(prompts, max_new_tokens=6, stop_tokens=[], temperature=0.9, top_k=40, seed=4)
        agree(s == sampled, f"{name} pp={pp}: sampled tokens (seed 4)")
        # one decode step: one hidden state per row over each boundary, 1/T from each tp rank
        cache = m.new_cache(3, 12)
        cache.valid[:, :10] = True
        m.forward(ids, np.arange(9)[None].repeat(3, 0), cache, last_only=True)
        before = st.pp.traffic.by_collective["send"]
        m.forward(ids[:, :1], np.full((3, 1), 9), cache, last_only=True)
        sent = st.pp.traffic.by_collective["send"] - before
        from mpitp.plan.infer import pp_boundary_bytes_per_rank

        H, T = one.config.hidden_size, st.tp.size  # the plan's figure (mpitp plan infer), to the byte
        want_sent = 0 if m.is_last else pp_boundary_bytes_per_rank(one.config, T, batch=3)
        agree(want_sent in (0, -(-3 * H // T) * 4), f"plan: {want_sent} bytes")
        agree(sent == want_sent, f"pp={pp}: stage {st.index} sent {sent} bytes in a step, expected {want_sent}")
        st.free()


def test_bad_layouts_are_refused_on_every_rank(world, models):
    """pp not dividing the world, or more stages than layers: an error on every rank, no hang."""
    bad = [p for p in range(2, N + 2) if N % p][:1] or [N + 1]
    for pp, words in ((bad[0], "does not divide"), (7, "more pipeline stages than the model's 5 layers")):
        if pp == 7 and N % 7:
            continue  # the divisibility error comes first
        with pytest.raises(PipelineError, match=words):
            LlamaForCausalLM.from_pretrained(models / "deep", comm=world, pp=pp)
    from mpitp.models.pipeline import balance

    c = LlamaForCausalLM.from_pretrained(models / "deep").config
    with pytest.raises(PipelineError, match="more pipeline stages than the model's 5 layers"):
        balance(c, 6)
    assert balance(c, 2) in ([(0, 3), (3, 5)], [(0, 2), (2, 5)])  # uneven: 5 layers over 2
