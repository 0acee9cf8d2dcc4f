"""Pipeline stages' layer cut (mpitp.models.pipeline.balance) against a brute-force search
of every cut: for P = 2-5 stages on byte profiles where the embedding and head weigh
nothing, as much as a layer, or as much as several (a large vocabulary), tied or not, the
largest stage is as small as any cut can make it."""

from itertools import combinations

import pytest

from mpitp.models.config import LlamaConfig
from mpitp.models.pipeline import PipelineError, balance, layer_params


def config(layers: int, vocab: int, hidden: int = 64, tied: bool = False) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=172, num_hidden_layers=layers,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=8, tie_word_embeddings=tied)  # fmt: skip


def stage_costs(c: LlamaConfig, bounds: list[tuple[int, int]]) -> list[int]:
    """Parameters each stage holds: its layers; the first the embedding table, the last the
    final norm and the head (its own table, or the tied one's copy)."""
    per, table = layer_params(c), c.vocab_size * c.hidden_size
    out = [(b - a) * per for a, b in bounds]
    out[0] += table
    out[-1] += table + c.hidden_size
    return out


def brute_force(c: LlamaConfig, P: int) -> list[tuple[int, int]]:
    """Of every cut of the layers into P contiguous non-empty runs, one whose largest stage is
    smallest; of those, the first in lexicographic order of the cut points."""
    L = c.num_hidden_layers
    best, pick = None, None
    for cuts in combinations(range(1, L), P - 1):  # lexicographic order
        edges = [0, *cuts, L]
        bounds = list(zip(edges, edges[1:]))
        worst = max(stage_costs(c, bounds))
        if best is None or worst < best:
            best, pick = worst, bounds
    assert pick is not None
    return pick


PROFILES = [
    config(7, 16),  # head and embedding ~ nothing
    config(9, 512),  # about a layer each
    config(12, 4096),  # several layers' worth: the end stages get fewer layers
    config(10, 2048, tied=True),
    config(6, 100, hidden=96),
    config(11, 1500, hidden=32),
]


@pytest.mark.parametrize("P", [2, 3, 4, 5])
@pytest.mark.parametrize("c", PROFILES, ids=[f"L{c.num_hidden_layers}-V{c.vocab_size}" for c in PROFILES])
def test_balance_is_the_brute_force_optimum(c, P):
    got = balance(c, P)
    assert len(got) == P and got[0][0] == 0 and got[-1][1] == c.num_hidden_layers
    assert all(a < b for a, b in got) and all(x[1] == y[0] for x, y in zip(got, got[1:]))  # contiguous, non-empty
    want = brute_force(c, P)
    assert max(stage_costs(c, got)) == max(stage_costs(c, want)), (got, want)


def test_more_stages_than_layers_is_refused():
    with pytest.raises(PipelineError, match="more pipeline stages than the model's 3 layers"):
        balance(config(3, 16), 4)
    with pytest.raises(PipelineError, match="at least 1"):
        balance(config(3, 16), 0)
