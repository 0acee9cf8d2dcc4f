"""``mpitp train`` under a real mpiexec: the same global batch at N = 1..4 and in every mode
gives the same losses and parameters; a checkpoint saved at 4 ranks resumes at 2 and 3 as
the uninterrupted run continues; traffic and memory per mode match the plan to the byte;
export loads in mpitp (and transformers, when installed); broken checkpoints and bad
arguments get clear errors."""

import json
import os
import sys
import textwrap

import numpy as np
import pytest
from train_helpers import TRAIN, losses, make_ids, params, rel, train

from mpitp import launch


@pytest.fixture(scope="module")
def ids(tmp_path_factory):
    return make_ids(tmp_path_factory.mktemp("data") / "ids.npy")


@pytest.fixture(scope="module")
def reference(ids, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    train(1, out, ids, "--steps", 4, "--dtype", "float64", "--grad-accum", 2, "--mode", "fsdp")
    return out


BOTH = pytest.mark.both_mpis  # nonblocking gathers and reductions in flight: each library's progress


@pytest.mark.parametrize(
    "n,mode,extra",
    [
        (2, "fsdp", ()),
        pytest.param(3, "fsdp", (), marks=BOTH),
        (4, "fsdp", ()),
        pytest.param(3, "ddp", (), marks=BOTH),
        (3, "zero1", ()),
        (3, "zero2", ()),
        pytest.param(4, "zero2", (), marks=BOTH),
        (2, "ddp", ()),
        (3, "fsdp", ("--recompute",)),
    ],
)
def test_same_training_at_any_n_and_mode(ids, reference, tmp_path, n, mode, extra):
    train(n, tmp_path, ids, "--steps", 4, "--dtype", "float64", "--grad-accum", 2, "--mode", mode, *extra)
    assert rel(losses(tmp_path), losses(reference)) <= 1e-10
    assert rel(params(tmp_path), params(reference)) <= 1e-10
    assert losses(reference)[-1] < losses(reference)[0]  # it learns


def test_float32_across_n(ids, tmp_path):
    train(1, tmp_path / "a", ids, "--steps", 4, "--mode", "fsdp")
    train(2, tmp_path / "b", ids, "--steps", 4, "--mode", "fsdp")
    train(3, tmp_path / "c", ids, "--steps", 4, "--mode", "ddp")
    for other in ("b", "c"):
        assert rel(losses(tmp_path / other), losses(tmp_path / "a")) <= 1e-5
        assert rel(params(tmp_path / other), params(tmp_path / "a")) <= 1e-4


@BOTH
def test_resume_at_other_n(ids, tmp_path):
    common = ("--steps", 6, "--dtype", "float64", "--shuffle", 7, "--schedule", "cosine")
    train(4, tmp_path / "whole", ids, *common, "--mode", "fsdp")
    train(4, tmp_path / "part", ids, *common, "--mode", "fsdp", "--save-every", 3)
    for n, mode in ((2, "fsdp"), (3, "zero1")):
        out = tmp_path / f"resumed{n}"
        out.mkdir()
        os.symlink(tmp_path / "part" / "step-000003", out / "step-000003")
        (out / "latest").write_text("step-000003\n")
        train(n, out, ids, *common, "--mode", mode, "--resume", out)
        assert rel(losses(out), losses(tmp_path / "whole")[3:]) <= 1e-10
        assert rel(params(out), params(tmp_path / "whole")) <= 1e-10


PROBE = textwrap.dedent("""
    import json, sys, numpy as np, mpitp
    from mpitp.plan.fsdp import fp32_memory, train_step_bytes
    from mpitp.train.trainer import Options, Trainer
    comm = mpitp.Communicator()
    rows = {}
    for mode in ("ddp", "zero1", "zero2", "fsdp"):
        t = Trainer(Options(config="tiny", data=sys.argv[1], mode=mode, steps=2, batch=6, seq=16, grad_accum=2,
                            algorithm="ring", eval_fraction=0), comm)
        t.train_step()                          # the first step allocates; count the second
        comm.traffic.reset()
        t.train_step()
        sent = comm.traffic.total
        padded = [u.padded for u in t.S.units]
        L = t.cfg.num_hidden_layers
        plan = train_step_bytes(padded, [0 < i <= L for i in range(len(padded))], [u.keep for u in t.S.units],
                                comm.size, mode, 4, accum=2)
        mem = t.memory()
        biggest = max(u.padded for u in t.S.units if not u.keep) * 4
        kept = sum(u.padded for u in t.S.units if u.keep) * 4
        rows[mode] = dict(sent=sent, plan=plan, psi_padded=sum(padded) * 4, held=mem["total"],
                          formula=fp32_memory(padded, comm.size, mode), peak=t.S.peak_gathered,
                          peak_bound=kept + 2 * biggest)
    every = comm.mpi.gather(rows, root=0)
    if comm.rank == 0:
        print("PROBE" + json.dumps(every))
""")


@pytest.mark.parametrize("n", [2, 3])
def test_traffic_and_memory_per_mode(ids, n):
    res = launch.run(n, [sys.executable, "-c", PROBE, str(ids)], timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    ranks = json.loads(res.stdout.split("PROBE", 1)[1])
    for rows in ranks:
        for mode, r in rows.items():
            assert r["sent"] == r["plan"], (mode, r)  # every byte as planned
            assert r["held"] == r["formula"], (mode, r)  # ZeRO's 16Ψ/N family, fp32
        psi, ring = rows["fsdp"]["psi_padded"], (n - 1) / n
        # fsdp 3Ψ (less the head's backward gather, adjacent to its forward, and the
        # embedding's, whose backward needs no weights; ×2 micro-batches) against ddp's 2Ψ
        assert rows["ddp"]["sent"] == 2 * ring * psi + 8
        assert rows["fsdp"]["sent"] > 1.2 * rows["ddp"]["sent"]
        assert rows["fsdp"]["held"] * n == rows["ddp"]["held"]
        assert 0 < rows["fsdp"]["peak"] <= rows["fsdp"]["peak_bound"]


def test_export_loads_in_mpitp_and_transformers(ids, tmp_path):
    train(2, tmp_path / "run", ids, "--steps", 3, "--mode", "fsdp")
    res = launch.run(
        1, [sys.executable, "-m", "mpitp.cli.main", "export", str(tmp_path / "run"), str(tmp_path / "hf")], timeout=60
    )
    assert res.returncode == 0, res.stderr
    from mpitp.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    x = np.load(ids)[:40][None]
    logits = model(x)
    # the exported weights are the trained ones: mpitp's inference loss equals the
    # training engine's loss on the same window
    from mpitp.train.trainer import Options, Trainer

    t = Trainer(Options(resume=str(tmp_path / "run"), data=str(ids), seq=39, eval_fraction=0, mode="ddp"))
    want = t.engine.loss(x[:, :-1], x[:, 1:]) / 39
    z = logits[0, :-1].astype(np.float64)
    got = float(np.mean(np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1) - z[np.arange(39), x[0, 1:]]))
    assert abs(got - want) <= 1e-5 * want
    torch = pytest.importorskip("torch")  # the transformers half: a reported skip without it
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        ref = hf(torch.tensor(x)).logits.numpy()
    assert np.abs(ref - logits).max() <= 1e-4


def test_corrupt_truncated_and_half_written_checkpoints(ids, tmp_path):
    out = tmp_path / "run"
    train(2, out, ids, "--steps", 4, "--save-every", 2)
    good = out / "step-000002"
    # a save that died half way: a temporary directory, 'latest' still on the previous one
    (out / ".step-000006.tmp").mkdir()
    (out / ".step-000006.tmp" / "rank00000.safetensors").write_bytes(b"partial")
    (out / "latest").write_text("step-000002\n")
    res = train(2, out, ids, "--steps", 5, "--resume", out, progress=True)
    assert "step 5" in res.stderr
    # progress into a pipe (as into a SLURM .out): plain lines, no bar's carriage returns
    assert "\r" not in res.stderr and "train: step 3/5 (60%), loss " in res.stderr, res.stderr[-2000:]
    assert "train: step 5/5 (100%)" in res.stderr and "s elapsed" in res.stderr
    # a flipped byte, then a truncated file: the error names the file, on a clean exit
    f = good / "rank00001.safetensors"
    blob = bytearray(f.read_bytes())
    blob[-5] ^= 0xFF
    f.write_bytes(bytes(blob))
    res = train(2, tmp_path / "x", ids, "--steps", 5, "--resume", good, check=False)
    assert res.returncode == 2 and "rank00001.safetensors: checksum mismatch" in res.stderr, res.stderr[-2000:]
    f.write_bytes(bytes(blob[:100]))
    res = train(2, tmp_path / "x", ids, "--steps", 5, "--resume", good, check=False)
    assert res.returncode == 2 and "rank00001.safetensors" in res.stderr, res.stderr[-2000:]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--data", "/nonexistent/x.txt"], "no such file"),
        (["--seq", "5000"], "exceeds the model's max_position_embeddings"),
        (["--resume", "/nonexistent/run"], "no such directory"),
        (["--batch", "0"], "--batch must be at least 1"),
    ],
)
def test_bad_arguments(ids, tmp_path, args, message):
    argv = TRAIN + ["--config", "tiny", "--data", str(ids), "--steps", "1", "--no-progress", *args]
    res = launch.run(2, argv, timeout=60)
    assert res.returncode == 2 and message in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr


KILL_IN_SAVE = textwrap.dedent("""
    import os, signal, sys
    import mpitp.train.checkpoint as ck
    real = ck._write
    def write(tmp, rank, tensors):                       # runs in the background thread
        if rank == 1 and tmp.name == ".step-000004.tmp":
            (tmp / "rank00001.safetensors").write_bytes(b"half a file")
            os.kill(os.getpid(), signal.SIGKILL)         # the rank dies in the middle of the write
        return real(tmp, rank, tensors)
    ck._write = write
    from mpitp.cli.main import main
    sys.exit(main(sys.argv[1:]))
""")


WRITE_AFTER_THE_NEXT_STEP = textwrap.dedent("""
    import json, sys, time
    import mpitp.train.checkpoint as ck
    real = ck._write
    def logged(log, step):
        try:
            return any(json.loads(line)["step"] == step for line in log.read_text().splitlines())
        except (OSError, ValueError):                    # not there yet, or a line half written
            return False
    def write(tmp, rank, tensors):                       # runs in the checkpoint's thread
        if tmp.name == ".step-000002.tmp":               # checkpoint 2 waits until step 3 is logged
            for _ in range(600):
                if logged(tmp.parent / "log.jsonl", 3):
                    break
                time.sleep(0.05)
            else:
                raise RuntimeError("checkpoint 2 was written on the training thread: step 3 never came")
        return real(tmp, rank, tensors)
    ck._write = write
    from mpitp.cli.main import main
    sys.exit(main(sys.argv[1:]))
""")


def test_background_checkpoints_equal_synchronous_ones(ids, tmp_path):
    """--save-every writes in a thread on each rank while training goes on: each rank's
    writer of checkpoint 2 holds its file until step 3 is in the log, which only a write
    off the training thread lets happen (a synchronous one would wait for itself, and the
    run fails after 30 s saying so). The files are byte for byte those of --sync-save, and
    the run's losses are the same."""
    common = ("--steps", 5, "--save-every", 2, "--dtype", "float64")
    train(3, tmp_path / "bg", ids, *common, script=WRITE_AFTER_THE_NEXT_STEP)
    train(3, tmp_path / "sync", ids, *common, "--sync-save")
    assert losses(tmp_path / "bg") == losses(tmp_path / "sync")
    for step in ("step-000002", "step-000004", "step-000005"):
        a, b = (json.loads((tmp_path / r / step / "meta.json").read_text()) for r in ("bg", "sync"))
        assert [r["sha256"] for r in a["ranks"]] == [r["sha256"] for r in b["ranks"]], step
    assert not list((tmp_path / "bg").glob(".*.tmp"))  # every background write was completed


@pytest.mark.both_mpis  # what each launcher does when a rank is killed
def test_rank_killed_during_a_background_write_leaves_the_previous_checkpoint(ids, tmp_path):
    """A rank killed while its thread writes checkpoint 4: the job ends, ``latest`` still
    names checkpoint 2 (complete, checksums good), and a run resumed from it continues
    exactly as an uninterrupted one; its log holds each step once, as the uninterrupted
    run's (the steps after checkpoint 2 are dropped and done again, and the run says so)."""
    out = tmp_path / "run"
    same = ("--dtype", "float64", "--schedule", "constant")  # the schedule does not depend on --steps
    common = (*same, "--seq", 32, "--batch", 5, "--lr", "3e-3", "--warmup", 1, "--no-progress")  # as train() runs
    argv = [sys.executable, "-c", KILL_IN_SAVE, "train", "--config", "tiny", "--data", str(ids), *map(str, common)]
    res = launch.run(2, argv + ["--steps", "8", "--save-every", "2", "--out", str(out)], timeout=180)
    assert res.returncode != 0, res.stdout[-2000:]
    assert (out / "latest").read_text().strip() == "step-000002"
    assert (out / ".step-000004.tmp" / "rank00001.safetensors").read_bytes() == b"half a file"
    assert params(out).size  # every rank file of step 2 read back through its checksum
    reached = max(json.loads(line)["step"] for line in open(out / "log.jsonl"))
    assert reached >= 3  # the log went past the checkpoint the run resumes from
    with open(out / "log.jsonl", "a") as f:
        f.write('{"step": 4, "lo')  # a record cut short by the kill
    train(2, tmp_path / "whole", ids, "--steps", 4, *same)
    res = train(2, out, ids, "--steps", 4, *same, "--resume", out)
    assert f"the log had reached step {reached}, so {reached - 2} step(s) are done again" in res.stderr
    assert [json.loads(line)["step"] for line in open(out / "log.jsonl")] == [1, 2, 3, 4]  # each step once
    assert rel(losses(out), losses(tmp_path / "whole")) <= 1e-10
    assert rel(params(out), params(tmp_path / "whole")) <= 1e-10


MIXED = ("bfloat16", "bfloat16")


@pytest.mark.parametrize(
    "n,tp,mode,mixed",
    [(3, 1, "fsdp", None), (3, 1, "zero2", None), (4, 2, "fsdp", None), (3, 1, "fsdp", MIXED),
     (3, 1, "zero1", ("bfloat16", "float32")), (2, 1, "ddp", ("float32", "bfloat16")), (4, 2, "zero2", MIXED)],
)  # fmt: skip
def test_log_bytes_per_step_equal_the_plan(ids, tmp_path, n, tp, mode, mixed):
    """Each step's JSONL record gives the bytes this rank sent (traffic counters) and the
    busiest rank's: equal, to the byte, to what `mpitp plan train` says a rank sends, in
    float32 and with the gathers and reductions in bfloat16 (--param-dtype/--reduce-dtype)."""
    out = tmp_path / "run"
    policy = ("--param-dtype", mixed[0], "--reduce-dtype", mixed[1]) if mixed else ()
    train(n, out, ids, "--steps", 2, "--mode", mode, "--tp", tp, "--algorithm", "ring", "--batch", 6, *policy)
    recs = [json.loads(line) for line in open(out / "log.jsonl")]
    args = ["--model", "tiny", "--tp", str(tp), "--dp", str(n // tp), "--nodes", "1", "--mode", mode]
    plan = launch.run(1, [*TRAIN[:-1], "plan", "train", *args, "--batch", "6", "--seq", "32", "--json", *policy])
    row = next(r for r in json.loads(plan.stdout)["layouts"] if r["tp"] == tp)
    want = row["dp_bytes_per_rank"] + row["tp_bytes_per_rank"]
    assert [r["sent_bytes_max"] for r in recs] == [want, want], (recs, row)
    # every rank waits on its reductions' handles for some time, and never longer than the step
    assert all(0 < r["sent_bytes"] <= want and 0 < r["comm_wait_s"] < r["step_s"] for r in recs), recs


@pytest.fixture(scope="module")
def bf16_reference(ids, tmp_path_factory):
    """One rank, float64 masters and AdamW, the parameters rounded to bfloat16 before every
    use: the policy --param-dtype bfloat16 computed exactly (nothing to reduce)."""
    out = tmp_path_factory.mktemp("bf16ref")
    train(1, out, ids, "--steps", 4, "--dtype", "float64", "--param-dtype", "bfloat16", "--grad-accum", 2)
    return out


@pytest.mark.parametrize("n,mode", [(2, "fsdp"), (3, "zero2"), (3, "zero1"), (4, "ddp")])
def test_bf16_parameters_at_any_n_equal_the_rounded_reference(ids, bf16_reference, tmp_path, n, mode):
    """--param-dtype bfloat16 (float32 masters, gathers in bfloat16): the same losses and
    masters as the float64 reference within float32 tolerance, at N = 2-4; and not the
    float32 run's (the rounding is real)."""
    args = ("--steps", 4, "--grad-accum", 2, "--mode", mode)
    train(n, tmp_path / "bf16", ids, *args, "--param-dtype", "bfloat16")
    assert rel(losses(tmp_path / "bf16"), losses(bf16_reference)) <= 2e-6
    assert rel(params(tmp_path / "bf16"), params(bf16_reference)) <= 2e-5
    train(n, tmp_path / "f32", ids, *args)
    assert rel(losses(tmp_path / "f32"), losses(bf16_reference)) > 1e-6


def test_bf16_on_a_mesh_carries_the_activations_in_bf16(ids, bf16_reference, tmp_path):
    """On a 2x2 mesh, --param-dtype bfloat16 also rounds the tensor-parallel all-reduces of
    activations to bfloat16 (their bytes halve: the log-bytes test counts them). With
    float64 masters, so that nothing but the policy's roundings acts, the mesh equals
    tp 2 x dp 1 (the same roundings) to 1e-12 in losses and masters, and it is not the
    one-rank reference, which has no activations to round (2e-4 apart here). Runs in
    float32 are not compared across layouts: a bfloat16 rounding that two float32 sums
    take differently changes the trajectory by up to ~1e-4 (seen: 3e-6 and 2.5e-5)."""
    args = ("--steps", 4, "--grad-accum", 2, "--mode", "fsdp", "--tp", 2, "--param-dtype", "bfloat16")
    train(4, tmp_path / "mesh", ids, *args, "--dtype", "float64")
    train(2, tmp_path / "dp1", ids, *args, "--dtype", "float64")
    assert rel(losses(tmp_path / "mesh"), losses(tmp_path / "dp1")) <= 1e-12
    assert rel(params(tmp_path / "mesh"), params(tmp_path / "dp1")) <= 1e-12
    assert rel(losses(tmp_path / "mesh"), losses(bf16_reference)) > 5e-5


def test_bf16_reductions_stay_close_and_halve_the_bytes(ids, tmp_path):
    """--reduce-dtype bfloat16 as well: each sum of a reduction is rounded to bfloat16, so
    the run differs from the float32 one by bfloat16 roundings of the gradients only."""
    common = ("--steps", 4, "--mode", "fsdp", "--algorithm", "ring")
    train(2, tmp_path / "f32", ids, *common)
    train(2, tmp_path / "bf16", ids, *common, "--param-dtype", "bfloat16", "--reduce-dtype", "bfloat16")
    a, b = losses(tmp_path / "bf16"), losses(tmp_path / "f32")
    assert 0 < rel(a, b) <= 2e-3
    sent = [json.loads(line)["sent_bytes_max"] for line in open(tmp_path / "bf16" / "log.jsonl")]
    full = [json.loads(line)["sent_bytes_max"] for line in open(tmp_path / "f32" / "log.jsonl")]
    assert [2 * (s - 16) for s in sent] == [f - 16 for f in full]  # half, but for the two float64 scalars
    peak = [json.loads(line)["gathered_peak_bytes"] for line in open(tmp_path / "bf16" / "log.jsonl")]
    peak32 = [json.loads(line)["gathered_peak_bytes"] for line in open(tmp_path / "f32" / "log.jsonl")]
    assert 0 < peak[-1] < peak32[-1]  # the units in flight are held in bfloat16
