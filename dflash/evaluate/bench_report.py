"""The standard prompt sets' results (`dflash eval --bench`) as a table for stdout and a bar plot of tau
per category (bench_tau.png, matplotlib Agg)."""

from __future__ import annotations

from pathlib import Path


def _rows(bench: dict) -> list[tuple[str, str, dict]]:
    """(set, group, numbers): each category, MT-Bench's turns, then the set overall."""
    rows = []
    for name, s in bench.items():
        rows += [(name, cat, c) for cat, c in s["categories"].items() if len(s["categories"]) > 1]
        rows += [(name, f"turn {t}", c) for t, c in s["turns"].items() if len(s["turns"]) > 1]
        rows.append((name, "all", s))
    return rows


def bench_table(bench: dict) -> str:
    """One line per category and per set: tau, lossless, speed-up, prompts and new tokens."""
    lines = [f"{'prompt set':<11} {'category':<11} {'tau':>6} {'lossless':>8} {'speed-up':>8} {'prompts':>7} "
             f"{'tokens':>8}"]
    for name, group, c in _rows(bench):
        speedup = f"{c['speedup']:.2f}x" if c.get("speedup") else "-"
        lines.append(f"{name:<11} {group:<11} {c['tau']:>6.3f} {str(c['lossless']):>8} {speedup:>8} "
                     f"{c['num_prompts']:>7} {c['new_tokens']:>8}")
    notes = [f"{name}: {len(s['prompts_left_out'])} turn(s) longer than the target's context left out"
             for name, s in bench.items() if s.get("prompts_left_out")]
    return "\n".join(lines + notes)


def plot_bench(bench: dict, out_dir: Path) -> Path:
    """bench_tau.png: tau of each category of each prompt set and of each set overall, one colour a set."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    rows = [r for r in _rows(bench) if not r[1].startswith("turn ")]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(rows) + 1.5), 4))
    colours = {name: f"C{i}" for i, name in enumerate(bench)}
    bars = ax.bar(range(len(rows)), [c["tau"] for _, _, c in rows], color=[colours[n] for n, _, _ in rows],
                  edgecolor=["black" if g == "all" else "none" for _, g, _ in rows])
    ax.bar_label(bars, labels=[f"{c['tau']:.2f}" for _, _, c in rows], fontsize=7)
    ax.set_xticks(range(len(rows)), [f"{n}: {g}" if g == "all" else g for n, g, _ in rows], rotation=45,
                  ha="right", fontsize=8)
    ax.set(ylabel="acceptance length tau", title="tau per category (online, lossless check)",
           ylim=(0, 1.25 * max(c["tau"] for _, _, c in rows)))  # room for the legend above the bars
    ax.grid(alpha=0.3, axis="y")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    ax.legend(handles, list(colours), fontsize=8, loc="upper left", ncol=len(colours))
    path = Path(out_dir) / "bench_tau.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


__all__ = ["bench_table", "plot_bench"]
