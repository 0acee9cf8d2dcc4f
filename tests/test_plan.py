"""mpitp plan reproduces the seeds' numbers and the ZeRO paper's Table 1 (from --json)."""

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

MPITP = [sys.executable, "-m", "mpitp.cli.main", "plan"]


def plan(*args):
    out = subprocess.run(MPITP + list(args) + ["--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_seed_000_hierarchical_example():
    res = plan("allreduce", "--nodes", "2", "--ranks-per-node", "4", "--size", "8MB")
    rows = {r["algorithm"]: r for r in res["algorithms"]}
    MB = 10**6
    assert rows["naive"]["inter_bytes_per_node"] == 32 * MB  # 4 GPUs x 8 MB
    assert rows["hierarchical_sharp"]["inter_bytes_per_node"] == 8 * MB  # B per node
    assert rows["hierarchical_sharp"]["inter_reduction_vs_naive"] == 4.0  # N = 4x less
    assert rows["hierarchical"]["inter_bytes_per_node"] == 8 * MB
    assert rows["hierarchical_leader"]["inter_bytes_per_node"] == 8 * MB
    assert rows["ring"]["inter_bytes_per_node"] == 14 * MB  # 2(N-1)/N * B, N = 8
    prof = res["profile"]
    fast, slow = prof["intra"], prof["inter"]
    assert fast["beta"] == 600e9 and slow["beta"] == 25e9  # NVLink 600 GB/s, IB 200 Gb/s
    t_slow = lambda x: slow["alpha"] + x / slow["beta"]  # noqa: E731
    t_fast = lambda x: fast["alpha"] + x / fast["beta"]  # noqa: E731
    assert rows["naive"]["time_s"] == pytest.approx(t_slow(8 * MB * 4))  # T_slow(B*N)
    assert rows["hierarchical_sharp"]["time_s"] == pytest.approx(t_fast(8 * MB * 4) + t_slow(8 * MB))
    assert rows["naive"]["formula"] == "T_slow(B*L)"
    assert rows["hierarchical_sharp"]["formula"] == "T_fast(B*L) + T_slow(B)"


def test_seed_004_llama2_7b_tp2():
    res = plan("tp", "--model", "llama2-7b", "--tp", "2", "--batch", "1", "--seq", "2048", "--dtype", "fp16")
    s = res["shards"]
    assert s["q_proj"] == s["k_proj"] == s["v_proj"] == [4096, 2048]
    assert s["gate_proj"] == s["up_proj"] == [4096, 5504] and s["down_proj"] == [5504, 4096]
    pre = res["prefill"]
    assert pre["allreduces"] == 64
    assert pre["bytes_each"] == 1 * 2048 * 4096 * 2 == 16 * 2**20
    assert pre["bytes_total"] == 2**30  # ~1 GiB per forward
    assert 1.6e-3 < pre["time_volume_s"] < 1.85e-3  # ~1.7 ms at 600 GB/s
    assert res["weights_total_bytes"] == pytest.approx(14e9, rel=0.05)  # "14 GB model"
    assert res["weights_per_rank_bytes"] == pytest.approx(7e9, rel=0.05)  # TP=2: 7 GB
    assert res["decode_step"]["bytes_each"] == 4096 * 2
    tp8 = plan("tp", "--model", "llama2-7b", "--tp", "8")
    assert tp8["weights_per_rank_bytes"] == pytest.approx(1.75e9, rel=0.05)  # TP=8: 1.75 GB


def test_seed_000_merged_qkv_offset():
    s = plan("tp", "--model", "llama2-7b", "--tp", "4")["shards"]
    assert s["qkv_local_offsets"] == {"q": 0, "k": 1024, "v": 2048}  # [4096]*3, tp 4: k at 1024


def test_gqa_presets_and_config_path(tmp_path):
    s = plan("tp", "--model", "llama3-8b", "--tp", "8")["shards"]
    assert s["k_proj"] == [4096, 128] and s["kv_heads_per_rank"] == 1
    s = plan("tp", "--model", "llama2-70b", "--tp", "16")["shards"]
    assert s["kv_replication"] == 2  # 8 KV heads on 16 ranks
    cfg = {
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 1376,
        "vocab_size": 32000,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    res = plan("tp", "--model", str(tmp_path), "--tp", "2", "--seq", "16", "--dtype", "fp32")
    assert res["shards"]["q_proj"] == [512, 256] and res["prefill"]["allreduces"] == 16


def test_uneven_tp_and_the_one_clear_error():
    res = plan("tp", "--model", "llama2-7b", "--tp", "3")
    ranks = res["shards"]["per_rank"]
    assert [r["q_heads"][1] - r["q_heads"][0] for r in ranks] == [11, 11, 10]  # 32 heads on 3 ranks
    assert sum(r["intermediate"] for r in ranks) == 11008
    out = subprocess.run(MPITP + ["tp", "--model", "llama2-7b", "--tp", "40"], capture_output=True, text=True)
    assert out.returncode == 2 and "tensor-parallel size 40 exceeds the number of attention heads = 32" in out.stderr
    assert "Traceback" not in out.stderr


def test_zero_paper_table_1():
    res = plan("fsdp", "--params", "7.5e9", "--ranks", "64")
    mem = {r["stage"]: r["memory_bytes"] / 1e9 for r in res["stages"]}
    assert round(mem["dp"], 1) == 120.0
    assert round(mem["zero1"], 1) == 31.4
    assert round(mem["zero2"], 1) == 16.6
    assert round(mem["zero3"], 2) == 1.88
    vol = {r["stage"]: r["volume_psi"] for r in res["stages"]}
    assert vol == {"dp": 2, "zero1": 2, "zero2": 2, "zero3": 3}


def test_fit_writes_local_profile_that_plan_reads(tmp_path):
    import os

    from mpitp import launch

    env = dict(os.environ, MPITP_TUNING=str(tmp_path / "tuning.json"))
    res = launch.run(2, [sys.executable, "-m", "mpitp.cli.main", "plan", "fit"], timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "profile-local.json").exists()
    out = subprocess.run(MPITP + ["allreduce", "--profile", "local", "--json"], capture_output=True, text=True, env=env)
    prof = json.loads(out.stdout)["profile"]
    written = json.loads((tmp_path / "profile-local.json").read_text())
    assert prof["name"] == "local" and prof["intra"] == written["intra"]  # plan reads what fit measured


def test_fit_recovers_a_known_link():
    """alpha and beta from two half round trips of a link with known figures: 3 us, 5 GB/s."""
    from mpitp.plan.profiles import link_from_half_trips

    t = lambda n: 3e-6 + n / 5e9  # noqa: E731
    link = link_from_half_trips({8: t(8), 1 << 22: t(1 << 22)})
    assert link.alpha == pytest.approx(t(8), rel=1e-12) and link.beta == pytest.approx(5e9, rel=1e-9)
    assert link_from_half_trips({8: 1e-5, 1 << 22: 1e-5}).beta == pytest.approx(((1 << 22) - 8) / 1e-9)  # floor


@pytest.mark.parametrize("n,k", [(8, 4), (5, 3)])
def test_benchmark_measured_bytes_equal_predicted(n, k):
    from mpitp import launch

    res = launch.run(
        n,
        [
            sys.executable,
            "benchmarks/hierarchical.py",
            "--ranks-per-node",
            str(k),
            "--sizes",
            "4100,65536",
            "--iters",
            "1",
        ],
        timeout=240,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "measured == predicted for every row" in res.stdout


def test_train_on_a_mesh_tp_inside_nodes_moves_fewest_inter_node_bytes():
    """mpitp plan train: small at 4 ranks on 2 nodes. The 2-D layout (tp 2 inside each
    node x fsdp 2 across) sends the fewest bytes between nodes; the figures are worked
    out here by hand from the small config (V 4096, H 256, I 672, 4 layers, 4 heads)."""
    out = plan("train", "--model", "small", "--tp", "2", "--dp", "2", "--nodes", "2")
    rows = {(r["tp"], r["dp"]): r for r in out["layouts"]}
    assert set(rows) == {(1, 4), (2, 2), (4, 1)}
    inter = {k: r["inter_bytes_per_node"] for k, r in rows.items()}
    assert min(inter, key=inter.get) == (2, 2)
    embed, layer, head = 4096 * 256, 2 * 256 + 4 * 256 * 256 + 3 * 256 * 672, 256 + 4096 * 256
    psi = embed + 4 * layer + head
    assert out["params"] == psi
    # fsdp over 4: gathers in forward (all), in backward (the layers), a reduce-scatter (all);
    # each ring pass sends 3/4 of what it moves, 4 bytes each; + the loss and the norm
    assert rows[(1, 4)]["dp_bytes_per_rank"] == 3 * (2 * psi + 4 * layer) + 16
    assert rows[(1, 4)]["tp_bytes_per_rank"] == 0
    assert rows[(1, 4)]["memory_per_rank_bytes"] == 16 * psi / 4
    # tp 2: 4 per layer + 2 all-reduces of [512 tokens, 256] (each rank sends one half
    # twice), then 512 and 1024 numbers for the loss, + the norm's float64
    tokens = 8 // 2 * 128
    assert rows[(2, 2)]["tp_bytes_per_rank"] == (18 * tokens * 256 + tokens + 2 * tokens) * 4 + 8
    assert rows[(2, 2)]["tp_link"] == "intra" and rows[(4, 1)]["tp_link"] == "inter"
    assert rows[(4, 1)]["dp_bytes_per_rank"] == 0
    args = ["train", "--model", "small", "--tp", "2", "--dp", "2", "--nodes", "2"]
    text = subprocess.run(MPITP + args, capture_output=True, text=True).stdout
    assert "* tp2 x fsdp2" in text and "<- fewest inter-node bytes" in text.split("* tp2")[1].splitlines()[0]
    bad = subprocess.run(MPITP + ["train", "--tp", "3", "--dp", "1", "--nodes", "2"], capture_output=True, text=True)
    assert bad.returncode == 2 and "do not fill --nodes 2 evenly" in bad.stderr


def test_plan_tp_counts_block_weights_as_the_model_holds_them():
    """plan tp --weights q8_0 gives the bytes the model really holds when loaded with
    --weights q8_0 (but for the norms, which it holds as float32), and cuts the MLP on
    whole blocks as the model does."""
    pytest.importorskip("gguf")
    pytest.importorskip("numba")
    from mpitp.models import default
    from mpitp.models.layers import TPPlan
    from mpitp.models.llama import LlamaForCausalLM

    if default.gguf_file() is None:
        pytest.skip("the default model is not installed")
    path = default.ensure()
    m = LlamaForCausalLM.from_pretrained(path, weights="q8_0")
    assert set(m.weight_formats()) == {"Q8_0"}
    c = m.config
    norms = (2 * c.num_hidden_layers + 1) * c.hidden_size * 4
    res = plan("tp", "--model", str(path / "config.json"), "--tp", "1", "--weights", "q8_0")
    # the plan counts every parameter in the format (34 bytes per 32: the file's float16
    # scale, as the tiles hold it), the norms' too
    assert res["weights_per_rank_bytes"] == m.weight_bytes() - norms + round(norms / 4 * 34 / 32)
    # 1536 columns = 48 blocks of 32: at p = 5 the block rule gives 10, 10, 10, 9, 9 blocks,
    # where an element cut would give 308 or 307 (literal cuts, not the runtime's own rule)
    want = {2: [768, 768], 3: [512, 512, 512], 5: [320, 320, 320, 288, 288]}
    assert c.intermediate_size == 1536
    for p, cut in want.items():
        res = plan("tp", "--model", str(path / "config.json"), "--tp", str(p), "--weights", "q4_1")
        assert [r["intermediate"] for r in res["shards"]["per_rank"]] == cut
        assert TPPlan.of(c, p, 32).mlp == cut  # the model's own cut is the same


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_the_runtime_cut_is_numpy_array_split(n, parts):
    """The chunk sizes the ring, the plans and the FSDP shards share are numpy.array_split's
    (so the plan-vs-counter tests that use them rest on NumPy's cut, not on themselves)."""
    from mpitp.split import chunk_counts, offsets

    pieces = np.array_split(np.arange(n), parts)
    assert chunk_counts(n, parts) == [len(p) for p in pieces]
    assert offsets(chunk_counts(n, parts)) == [sum(map(len, pieces[:i])) for i in range(parts)]


def test_plan_infer_counts_stage_boundaries_and_all_reduces():
    """mpitp plan infer: 2 stages of TP=2 on 2 nodes keep every all-reduce inside a node and
    send one hidden state per row per step across (each tp rank its half) plus the tokens
    back; TP=4 over the same nodes sends every all-reduce across. Memory per rank: the
    stage's weights over T plus its KV cache."""
    from mpitp.plan import infer
    from mpitp.plan.profiles import get
    from mpitp.plan.tp import load_model

    m = load_model("llama2-7b")
    prof = get(None)
    res = infer.plan(m, 2, 2, 2, 1, 4096, prof)
    H, L = m.hidden_size, m.num_hidden_layers
    assert [r["layers"] for r in res["stages"]] == [[0, 16], [16, 32]]
    assert all(r["tp_inside_node"] for r in res["stages"])
    assert res["pp_boundary_bytes_per_rank"] == H * 4 // 2 and res["stage_boundaries_across_nodes"] == 1
    assert res["messages_per_step"]["inter"] == 2 + 1  # two halves of the hidden state, the tokens back
    assert res["bytes_per_step"]["inter"] == H * 4 + 8
    ars = 2 * L + 1  # two a layer, the embedding's one
    assert res["messages_per_step"]["intra"] == 2 * ars * 2 + 2 * 1  # 2 ranks x 2 messages; the head's gather
    kv = 2 * 16 * 4096 * (m.num_key_value_heads // 2) * m.head_dim * 4
    assert res["stages"][0]["kv_cache_per_rank_bytes"] == kv
    tp4 = infer.plan(m, 1, 4, 2, 1, 4096, prof)
    assert not tp4["stages"][0]["tp_inside_node"]  # the ring 0-1-2-3-0 crosses between nodes at 1-2 and 3-0
    assert tp4["messages_per_step"]["inter"] == 2 * (6 * ars + 3) and tp4["messages_per_step"]["intra"] == 2 * (
        6 * ars + 3
    )
    greedy = infer.plan(m, 1, 4, 2, 3, 4096, prof, greedy=True)  # the head: a 16-byte pair a row, not its logits
    logits = infer.plan(m, 1, 4, 2, 3, 4096, prof)
    head = sum(logits["bytes_per_step"].values()) - sum(greedy["bytes_per_step"].values())
    assert head == 4 * 3 * 3 * (m.vocab_size * 4 / 4 - 16)  # 4 ranks, 3 messages of 3 rows each
    assert greedy["messages_per_step"] == logits["messages_per_step"]
    x = infer.crossover(m, 2, 1, 2, 1, prof)
    assert x is not None and x >= 0
    from dataclasses import replace
    from pathlib import Path

    from mpitp.models.config import LlamaConfig

    o = LlamaConfig.from_path(Path(__file__).parent / "fixtures" / "olmoe")  # q/k normed over the projection
    with_norms, without = (infer.plan(c, 1, 2, 1, 3, 64, prof) for c in (o, replace(o, qk_norm_whole=False)))
    L = o.num_hidden_layers  # one more all-reduce a layer, of 3 rows' 2 floats: a ring of 2 sends 24 bytes a rank
    assert with_norms["stages"][0]["allreduces"] - without["stages"][0]["allreduces"] == L
    assert with_norms["bytes_per_step"]["intra"] - without["bytes_per_step"]["intra"] == 2 * L * 24
    out = subprocess.run(
        [sys.executable, "-m", "mpitp.cli.main", "plan", "infer", "--pp", "2", "--tp", "1", "--link", "1gbit",
         "--latency", "100us"], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0 and "1 Gbit/s, 100 us" in out.stdout and "stage 1: layers 16-31" in out.stdout, out


def test_mixture_of_experts_shapes_in_the_plans():
    """The Qwen3 presets count what transformers counts (Qwen3-30B-A3B: 30.5B parameters, all
    128 experts of its 48 layers); plan tp holds half of them a rank at 2 ranks (auto: tp, every
    expert's 768 columns cut in K-quant super-blocks, 512 + 256 turned from expert to expert:
    384 a rank on average), streaming the k chosen of 128 a token; plan infer's
    chance that a token reaches a rank equals a count over uniform draws, and across 2 nodes
    data-parallel attention's all-to-all sends fewer bytes a token than tp's all-reduces."""
    import random

    from mpitp.plan import infer as pinf
    from mpitp.plan import tp as ptp

    m = ptp.PRESETS["qwen3-30b-a3b"]
    assert abs(ptp.params(m) / 1e9 - 30.53) < 0.01 and abs(ptp.params(ptp.PRESETS["qwen3-0.6b"]) / 1e9 - 0.596) < 0.001
    s = ptp.shard_shapes(m, 2, 256)["per_rank"]
    assert [(r["moe"], r["experts"], r["expert_columns"]) for r in s] == [("tp", 128, 384)] * 2
    from mpitp.models.moe import MoEPlan, expected_reads

    cut = MoEPlan.of(m, 2, "tp", 256)
    assert (cut.cut(0), cut.cut(1), cut.cut(2)) == ([512, 256], [256, 512], [512, 256])
    # the slowest rank's columns a token: ~4.4 experts' under tp, turned; ~5 under ep (imbalance)
    assert 4.2 * 768 < expected_reads(m, 2, "tp", 256) < 4.6 * 768 < 4.8 * 768 < expected_reads(m, 2, "ep", 256)
    assert abs(s[0]["weights"] / ptp.params(m) - 0.5) < 0.01 and 2.9e9 < 2 * s[0]["streamed"] < 3.5e9  # "A3B"
    hit = pinf.ranks_hit([43, 43, 42], 8)
    rng = random.Random(0)
    draws = [set(rng.sample(range(128), 8)) for _ in range(20000)]
    counted = sum(any(e >= 86 for e in d) for d in draws) / len(draws)
    assert abs(hit[2] - counted) < 0.01
    res = pinf.moe(m, 2, 2, 8, "q4_k")
    b = res["bytes_per_token"]
    assert res["auto"] == "tp" and b["dp"]["inter"] < b["tp_greedy"]["inter"] < b["tp"]["inter"]
    H, k, sparse = m.hidden_size, m.num_experts_per_tok, sum(m.sparse(i) for i in range(m.num_hidden_layers))
    experts = sparse * sum(pinf.ranks_hit(res["experts_per_rank_ep"], k)) * ((H + 2 * k) * 4 + H * 4) / 2
    assert abs(b["dp"]["inter"] - experts - ((H + 5) * 4 + 2 * 24)) <= 1  # the head's: a row out, 2 ranks' answers
    # a token's, both ranks: each its half of the row's logits (V·4/2 bytes) against a 16-byte pair
    assert abs(b["tp"]["inter"] - b["tp_greedy"]["inter"] - 2 * (m.vocab_size * 4 / 2 - 16)) <= 1
