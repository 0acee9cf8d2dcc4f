"""``mpitp train --tp T`` on a (N/T) x T mesh under a real mpiexec: losses and parameters
after K steps equal single-process training (float64 1e-10, float32 1e-5) for tp x fsdp,
tp x ddp and tp x ZeRO at 2 x 2, 3 x 2, 2 x 3 and 1 x 4, with GQA, biases, tied embeddings
and a Hugging Face start; a checkpoint saved at tp 2 x dp 2 resumes at tp 1 x dp 3 and at
tp 4 x dp 1 as the uninterrupted run continues; each rank's bytes per step, by group and
peer class with the tp groups inside simulated nodes, equal ``mpitp plan train``'s."""

import json
import os
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from train_helpers import TRAIN, losses, make_ids, params, rel, train

from mpitp import launch
from mpitp.train.checkpoint import Reader

FIXTURES = Path(__file__).parent / "fixtures"

CONFIGS = {
    # GQA 8/4 with every bias a LLaMA config can ask for; uneven cuts at tp 3
    "wide": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 512,
        "hidden_size": 48,
        "intermediate_size": 100,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 6,
        "attention_bias": True,
        "mlp_bias": True,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256,
    },
    # Qwen2: q/k/v biases, tied embeddings (the head shares the embedding's vocabulary cut)
    "qwen": {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 512,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256,
    },
}

STEPS = ("--steps", 4, "--dtype", "float64", "--grad-accum", 2)


@pytest.fixture(scope="module")
def ids(tmp_path_factory):
    return make_ids(tmp_path_factory.mktemp("data") / "ids.npy")


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    d = tmp_path_factory.mktemp("configs")
    out = {"tiny": "tiny"}
    for name, cfg in CONFIGS.items():
        (d / f"{name}.json").write_text(json.dumps(cfg))
        out[name] = str(d / f"{name}.json")
    return out


@pytest.fixture(scope="module")
def references(ids, configs, tmp_path_factory):
    """Single-process float64 runs, one per config, made when first asked for."""
    done = {}

    def get(name):
        if name not in done:
            out = tmp_path_factory.mktemp(f"ref-{name}")
            train(1, out, ids, "--config", configs[name], *STEPS)
            done[name] = out
        return done[name]

    return get


@pytest.mark.parametrize(
    "config,n,tp,mode,extra",
    [
        pytest.param("tiny", 4, 2, "fsdp", (), marks=pytest.mark.both_mpis),  # 2 x 2: the groups' collectives
        ("tiny", 6, 2, "fsdp", ()),  # dp 3 x tp 2
        ("tiny", 4, 2, "ddp", ()),
        ("tiny", 6, 2, "ddp", ("--recompute",)),
        pytest.param("wide", 6, 3, "zero2", (), marks=pytest.mark.both_mpis),  # dp 2 x tp 3: 4 KV heads cut 2 + 1 + 1
        ("wide", 4, 4, "fsdp", ()),  # tp alone
        ("qwen", 4, 2, "zero1", ()),
    ],
)
def test_mesh_trains_as_one_process(ids, configs, references, tmp_path, config, n, tp, mode, extra):
    train(n, tmp_path, ids, "--config", configs[config], *STEPS, "--tp", tp, "--mode", mode, *extra, timeout=240)
    ref = references(config)
    assert rel(losses(tmp_path), losses(ref)) <= 1e-10
    assert rel(params(tmp_path), params(ref)) <= 1e-10
    meta = Reader(tmp_path).meta
    assert meta["mesh"] == {"dp": n // tp, "tp": tp}
    for i, unit in enumerate(meta["units"]):  # every element saved once, by one rank
        covered = sorted(tuple(r) for rank in meta["ranks"] for r in rank["ranges"][i])
        assert sum(b - a for a, b in covered) == unit["numel"]
        assert all(a == prev[1] for prev, (a, _) in zip(covered, covered[1:])) and covered[0][0] == 0


def test_float32(ids, tmp_path):
    train(1, tmp_path / "one", ids, "--steps", 4)
    train(4, tmp_path / "mesh", ids, "--steps", 4, "--tp", 2, "--mode", "fsdp")
    assert rel(losses(tmp_path / "mesh"), losses(tmp_path / "one")) <= 1e-5
    # AdamW's first steps divide by sqrt(v) ~ |g|, so float32 rounding in g moves the
    # parameters by more than the losses: 3.6e-6 and 1.2e-5 measured in two runs
    assert rel(params(tmp_path / "mesh"), params(tmp_path / "one")) <= 1e-4


def test_hugging_face_start(tmp_path):
    """Fine-tuning the Qwen2 fixture (its own weights, q/k/v biases) on a 2 x 2 mesh."""
    data = tmp_path / "ids.npy"
    np.save(data, np.random.default_rng(1).integers(0, 250, 2000))
    common = ("--init", FIXTURES / "qwen2", "--seq", 16, "--batch", 4, *STEPS)
    train(1, tmp_path / "one", data, *common)
    train(4, tmp_path / "mesh", data, *common, "--tp", 2)
    assert rel(losses(tmp_path / "mesh"), losses(tmp_path / "one")) <= 1e-10
    assert rel(params(tmp_path / "mesh"), params(tmp_path / "one")) <= 1e-10


def test_resume_on_another_mesh(ids, configs, tmp_path):
    common = ("--config", configs["wide"], "--steps", 6, "--dtype", "float64", "--shuffle", 7)
    train(1, tmp_path / "whole", ids, *common)
    train(4, tmp_path / "part", ids, *common, "--tp", 2, "--save-every", 3)
    for n, tp, mode in ((3, 1, "zero1"), (4, 4, "fsdp")):
        out = tmp_path / f"tp{tp}"
        out.mkdir()
        (out / "step-000003").symlink_to(tmp_path / "part" / "step-000003")
        (out / "latest").write_text("step-000003\n")
        train(n, out, ids, *common, "--tp", tp, "--mode", mode, "--resume", out)
        assert rel(losses(out), losses(tmp_path / "whole")[3:]) <= 1e-10
        assert rel(params(out), params(tmp_path / "whole")) <= 1e-10
    # the mesh's own last checkpoint exports to the same Hugging Face tensors as one process's
    from safetensors.numpy import load_file

    from mpitp.train.checkpoint import export_hf

    mesh = load_file(export_hf(tmp_path / "part", tmp_path / "hf-mesh") / "model.safetensors")
    whole = load_file(export_hf(tmp_path / "whole", tmp_path / "hf-whole") / "model.safetensors")
    assert mesh.keys() == whole.keys() and "model.layers.1.self_attn.o_proj.bias" in mesh
    for name in whole:
        assert mesh[name].shape == whole[name].shape and rel(mesh[name], whole[name]) <= 1e-5, name


PROBE = textwrap.dedent("""
    import json, sys, mpitp
    from mpitp.plan.train import rank_bytes
    from mpitp.train.trainer import Options, Trainer
    comm = mpitp.Communicator()
    rows = {}
    for mode in ("fsdp", "ddp", "zero2"):
        t = Trainer(Options(config="tiny", data=sys.argv[1], mode=mode, tp=2, steps=2, batch=5, seq=16,
                            grad_accum=2, algorithm="ring", eval_fraction=0), comm)
        t.train_step()                          # the first step allocates; count the second
        for c in (t.tp, t.dp):
            c.traffic.reset()
        t.train_step()
        plan = rank_bytes(t.cfg, 2, t.n, mode, 5, 16, 4, tp_rank=t.tp_rank, dp_rank=t.rank, accum=2)
        rows[mode] = dict(tp=dict(t.tp.traffic.by_peer), dp=dict(t.dp.traffic.by_peer), plan=plan)
        t.close()
    every = comm.mpi.gather(rows, root=0)
    if comm.rank == 0:
        print("PROBE" + json.dumps(every))
""")


@pytest.mark.parametrize("n", [4, 6])
def test_traffic_matches_the_plan_by_peer_class(ids, n):
    """Two ranks per simulated node: the tp rings stay inside nodes, the dp rings cross."""
    env = dict(os.environ, MPITP_RANKS_PER_NODE="2")
    res = launch.run(n, [sys.executable, "-c", PROBE, str(ids)], timeout=240, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    for rows in json.loads(res.stdout.split("PROBE", 1)[1]):
        for mode, r in rows.items():
            p = r["plan"]
            assert r["tp"] == {"intra": p["tp"], "mpi": p["tp_mpi"]}, (mode, r)
            assert r["dp"] == {"inter": p["dp"], "mpi": p["dp_mpi"]}, (mode, r)
            assert p["tp"] > 0 and p["dp"] > 0


@pytest.mark.parametrize(
    "n,args,message",
    [
        (4, ("--tp", "3"), "--tp 3 must divide the 4 rank(s)"),
        (4, ("--tp", "4"), "--tp 4 exceeds the model's 2 KV heads"),
    ],
)
def test_bad_mesh(ids, n, args, message):
    argv = TRAIN + ["--config", "tiny", "--data", str(ids), "--steps", "1", "--no-progress", *args]
    res = launch.run(n, argv, timeout=60)
    assert res.returncode != 0 and message in res.stderr, res.stderr[-2000:]
