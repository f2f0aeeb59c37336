"""PNG plots of an evaluation: acceptance by block position and the tau histogram (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path


def plot_eval(result: dict, out_dir: Path) -> list[Path]:
    """acceptance.png and tau_hist.png in `out_dir`, offline and online series side by side."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    series = [(name, result[name]) for name in ("offline", "online") if result.get(name)]
    B = series[0][1]["block_size"]
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in series:
        ax.plot(range(1, B), r["acceptance"], marker="o", label=f"{name} (tau {r['tau']:.2f})")
    ax.set(xlabel="block position k", ylabel="P(first k proposals accepted)", ylim=(0, 1.02),
           title="Acceptance by block position")
    ax.set_xticks(range(1, B))
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(Path(out_dir) / "acceptance.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / len(series)
    for i, (name, r) in enumerate(series):
        total = max(sum(r["tau_hist"]), 1)
        xs = [t + (i - (len(series) - 1) / 2) * width for t in range(1, B + 1)]
        ax.bar(xs, [c / total for c in r["tau_hist"]], width=width, label=f"{name} ({r['num_blocks']} blocks)")
    ax.set(xlabel="acceptance length tau", ylabel="share of blocks", title="tau histogram")
    ax.set_xticks(range(1, B + 1))
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    paths.append(Path(out_dir) / "tau_hist.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths
