"""loss.png: the train loss of every step and the held-out eval loss where measured."""

from __future__ import annotations

from pathlib import Path

from ..log import get_logger


def plot_loss(history: list, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        get_logger("train").warning("matplotlib is not installed: no loss.png (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], label="train")
    ev = [(h["step"], h["eval_loss"]) for h in history if h.get("eval_loss") is not None]
    if ev:
        ax.plot(*zip(*ev), "o-", label="eval (held-out tail)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
