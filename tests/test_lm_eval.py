"""lm-eval, the evaluation harness, against mpitp serve (TP = 2) as its ``local-completions``
model: a loglikelihood task read from a local file, two requests per batch (a list of
token-id prompts with ``echo`` and ``logprobs``). Each sample's log-likelihood and
is-greedy equal transformers' on the same model, in float64."""

import json

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install lm-eval)")
torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from test_serve import FIX, Server  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

DOCS = [
    ("the quick brown", " fox jumps"),
    ("hello", " world"),
    ("tensor parallel", " layers cut the weights"),
    ("a b c", " d e f"),
    ("MPI", "_Allreduce"),
]


def reference() -> dict[str, tuple[float, bool]]:
    """Each context's (log-likelihood of its continuation, whether greedy decoding gives it),
    from transformers in float64, tokenized as lm-eval does (the whole, then the context)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(FIX, torch_dtype=torch.float64).eval()
    tok = Tokenizer.from_file(str(FIX / "tokenizer.json"))
    out = {}
    for ctx, cont in DOCS:
        whole, n = tok.encode(ctx + cont).ids, len(tok.encode(ctx).ids)
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([whole])).logits[0], -1).numpy()
        rows = logp[n - 1 : len(whole) - 1]
        target = np.array(whole[n:])
        out[ctx] = (float(rows[np.arange(len(target)), target].sum()), bool((rows.argmax(-1) == target).all()))
    return out


def test_lm_eval_local_completions_loglikelihood(tmp_path, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"context": c, "continuation": t}) + "\n" for c, t in DOCS))
    (tmp_path / "task.yaml").write_text(
        f"""task: mpitp_loglikelihood
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
target_delimiter: ""
metric_list:
  - metric: perplexity
  - metric: acc
"""
    )
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # the task's data is a local file
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    want = reference()
    srv = Server(2)
    try:
        results = simple_evaluate(
            model="local-completions",
            model_args=f"model=mha,base_url={srv.url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={FIX},max_retries=1",
            tasks=["mpitp_loglikelihood"],
            task_manager=TaskManager(include_path=str(tmp_path)),
            batch_size=2,
            log_samples=True,
        )
    finally:
        assert srv.stop() == 0
    samples = results["samples"]["mpitp_loglikelihood"]
    assert len(samples) == len(DOCS)
    for s in samples:
        (ll, greedy) = s["resps"][0][0]
        ref_ll, ref_greedy = want[s["doc"]["context"]]
        assert abs(ll - ref_ll) <= 1e-4 * max(1.0, abs(ref_ll)), (s["doc"], ll, ref_ll)
        assert greedy == ref_greedy, s["doc"]
    acc = results["results"]["mpitp_loglikelihood"]["acc,none"]
    assert acc == np.mean([g for _, g in want.values()])
