"""Live parity with Hugging Face transformers, when it is installed: a freshly made random
model (GQA with replicated KV heads, tied embeddings, odd vocabulary), saved, loaded by
mpitp at TP 1 and 2, logits and greedy tokens compared."""

import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mpitp import launch  # noqa: E402


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    d = tmp_path_factory.mktemp("fresh")
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(
        vocab_size=301,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        max_position_embeddings=64,
        eos_token_id=None,
        bos_token_id=None,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(d, safe_serialization=True)
    ids = torch.randint(0, 301, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(ids).logits.numpy()
        greedy = model.generate(ids[:1], max_new_tokens=8, do_sample=False, pad_token_id=0)[0].numpy()
    np.savez(d / "ref.npz", ids=ids.numpy(), logits=logits, greedy=greedy)
    return d


def test_tp1_in_process(fresh):
    from mpitp.models.llama import LlamaForCausalLM

    ref = np.load(fresh / "ref.npz")
    m = LlamaForCausalLM.from_pretrained(fresh)
    assert np.abs(m(ref["ids"]) - ref["logits"]).max() <= 1e-4
    assert m.generate([ref["ids"][0].tolist()], max_new_tokens=8, stop_tokens=[])[0] == ref["greedy"].tolist()


@pytest.mark.parametrize("n", [2, 4])
def test_tp_under_mpiexec(fresh, n):
    script = textwrap.dedent(f"""
        import numpy as np, mpitp
        from mpitp.models.llama import LlamaForCausalLM
        comm = mpitp.Communicator()
        ref = np.load("{fresh}/ref.npz")
        m = LlamaForCausalLM.from_pretrained("{fresh}", comm=comm)
        d = float(np.abs(m(ref["ids"]) - ref["logits"]).max())
        g = m.generate([ref["ids"][0].tolist()], max_new_tokens=8, stop_tokens=[])[0] == ref["greedy"].tolist()
        ok = comm.mpi.allreduce(int(d <= 1e-4 and g), op=__import__("mpi4py").MPI.MIN)
        comm.rank or print("parity", ok, d)
    """)
    res = launch.run(n, [sys.executable, "-c", script], timeout=180)
    assert res.returncode == 0, res.stderr
    assert "parity 1" in res.stdout, res.stdout
