"""busbw against message size, one line per algorithm, with the memcpy ceiling."""

from __future__ import annotations


def busbw_plot(rows: list[dict], memcpy_gbs: float, path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("mpitp bench --plot needs matplotlib: pip install 'mpitp[plot]'") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for alg in dict.fromkeys(r["algorithm"] for r in rows):
        pts = sorted((r["size_bytes"], r["busbw_gbs"]) for r in rows if r["algorithm"] == alg and r["size_bytes"])
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=alg)
    ax.axhline(memcpy_gbs, color="gray", linestyle="--", label=f"memcpy {memcpy_gbs:.1f} GB/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
