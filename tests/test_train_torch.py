"""mpitp training against PyTorch: a LLaMA made by transformers, trained K steps with
``torch.optim.AdamW`` (weight decay on >=2-D weights, as nanoGPT groups them) and
``clip_grad_norm_`` on the windows mpitp's data section defines, against
``mpiexec -n N mpitp train --init`` on the same directory and ids (float32): per-step
losses within 1e-5 relative, and each tensor's *change* over the run within 1e-3 of
its size. A third run lets weight decay dominate the change (lr x weight_decay = 0.2 a
step, eps = 1 so Adam's own step is small and float noise in tiny gradients is not
amplified): decay dropped, doubled, or put on the norms would all be off by ~100%."""

import json
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mpitp import launch  # noqa: E402
from mpitp.train.checkpoint import Reader  # noqa: E402

B, SEQ, CLIP = 6, 24, 1.0
CASES = {  # tied, mode, ranks, steps, lr, weight decay, eps
    "fsdp": (False, "fsdp", 2, 5, 2e-3, 0.1, 1e-8),
    "zero2-tied": (True, "zero2", 3, 5, 2e-3, 0.1, 1e-8),
    "decay-dominates": (False, "fsdp", 2, 3, 0.05, 4.0, 1.0),
}


@pytest.mark.parametrize("case", CASES)
def test_against_torch_adamw(tmp_path, case):
    tied, mode, n, STEPS, LR, WD, EPS = CASES[case]
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = transformers.LlamaConfig(
        vocab_size=301,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        rms_norm_eps=1e-5,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # norms away from 1, so their gradients matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path / "init", safe_serialization=True)
    init = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    stream = np.tile(np.random.default_rng(1).integers(0, 301, 50), 40)  # learnable: a repeating pattern
    np.save(tmp_path / "ids.npy", stream)

    # --- PyTorch: windows of SEQ+1 starting at i*SEQ; step k takes windows kB..(k+1)B-1
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}],
        lr=LR,
        betas=(0.9, 0.95),
        eps=EPS,
    )
    count = (len(stream) - 1) // SEQ
    ref_losses = []
    for k in range(STEPS):
        idx = (k * B + np.arange(B)) % count
        rows = torch.tensor(np.stack([stream[i * SEQ : i * SEQ + SEQ + 1] for i in idx]))
        logits = model(rows[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 301), rows[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        ref_losses.append(loss.item())

    # --- mpitp
    out = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "mpitp.cli.main",
        "train",
        "--init",
        str(tmp_path / "init"),
        "--data",
        str(tmp_path / "ids.npy"),
        "--steps",
        str(STEPS),
        "--batch",
        str(B),
        "--seq",
        str(SEQ),
        "--lr",
        str(LR),
        "--weight-decay",
        str(WD),
        "--betas",
        "0.9,0.95",
        "--eps",
        str(EPS),
        "--grad-clip",
        str(CLIP),
        "--schedule",
        "constant",
        "--eval-fraction",
        "0",
        "--mode",
        mode,
        "--out",
        str(out),
        "--no-progress",
    ]
    res = launch.run(n, argv, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    got = [json.loads(line)["loss"] for line in open(out / "log.jsonl")]
    assert np.abs(np.array(got) - ref_losses).max() <= 1e-5 * max(ref_losses), (got, ref_losses)
    assert case == "decay-dominates" or ref_losses[-1] < ref_losses[0]  # it learns
    r = Reader(out)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    worst, seen = {}, set()
    for i, unit in enumerate(r.meta["units"]):
        flat = r.read(i, "param", 0, unit["numel"], np.float32)
        for _key, name, shape, off in unit["tensors"]:
            mine = flat[off : off + int(np.prod(shape))].reshape(shape).astype(np.float64)
            ref = state[name] - init[name].astype(np.float64)
            size = np.linalg.norm(ref)
            assert size > 0, f"{name} did not move in PyTorch"
            worst[name] = float(np.linalg.norm((mine - init[name]) - ref) / size)
            seen.add(name)
    assert seen >= {k for k in state if "rotary" not in k} - ({"lm_head.weight"} if tied else set()), seen
    print(case, "worst relative error of a change:", max(worst.items(), key=lambda kv: kv[1]))
    assert max(worst.values()) <= 1e-3, sorted(worst.items(), key=lambda kv: -kv[1])[:5]
