"""PNG plots for the evaluation report (and later the model card).

Saved with `pipeline.plotting.save_png` (Agg backend, no version or timestamp metadata), so the
same results give the same bytes.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.plotting import pyplot, save_png

_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_DASHES = ("-", "--", "-.", ":")


def tau_bars(results: dict, path: Path) -> Path:
    """Grouped bars: acceptance length tau per subset (groups) and drafter variant (bars)."""
    plt = pyplot()
    variants = list(results["variant_order"])
    subsets = [s["name"] for s in results["subsets"]]
    width = 0.8 / max(len(variants), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(subsets) + 0.5 * len(variants)), 4.2))
    for i, v in enumerate(variants):
        taus = [results["variants"][v]["subsets"][s]["tau"] for s in subsets]
        xs = [j + (i - (len(variants) - 1) / 2) * width for j in range(len(subsets))]
        bars = ax.bar(xs, taus, width=width * 0.95, label=v)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
    ax.set_xticks(range(len(subsets)), subsets)
    ax.set_xlabel("prompt subset")
    ax.set_ylabel("acceptance length τ (accepted + 1 per step)")
    ax.set_ylim(0, results["block_size"] + 0.3)
    ax.axhline(1.0, color="grey", lw=0.6, ls=":")
    ax.set_title(f"Acceptance length per subset: {results['drafter']['name']} drafter variants\n"
                 f"target {results['target']['name']} ({results['target']['variant']}), greedy, "
                 f"block size {results['block_size']}")
    ax.legend(title="drafter variant", fontsize=8, title_fontsize=8, loc="upper left",
              bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", alpha=0.3)
    return save_png(fig, path, dpi=120, tight=True)


def acceptance_curves(results: dict, path: Path) -> Path:
    """Per-position acceptance: P(draft position k accepted) for k = 1..block_size-1, one panel per subset."""
    plt = pyplot()
    variants = list(results["variant_order"])
    subsets = [s["name"] for s in results["subsets"]]
    positions = list(range(1, results["block_size"]))
    fig, axes = plt.subplots(1, len(subsets), figsize=(3.6 * len(subsets) + 1.5, 3.6), sharey=True, squeeze=False)
    for ax, s in zip(axes[0], subsets):
        for i, v in enumerate(variants):
            rates = results["variants"][v]["subsets"][s]["position_acceptance"]
            # distinct markers and dashes keep coinciding curves visible
            ax.plot(positions, rates, marker=_MARKERS[i % len(_MARKERS)], ms=max(11 - 2 * i, 3), mfc="none",
                    mew=1.3, ls=_DASHES[i % len(_DASHES)], lw=1.4, alpha=0.85, label=v)
        ax.set_title(s)
        ax.set_xlabel("draft position k")
        ax.set_xticks(positions)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("P(position k accepted)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, title="drafter variant", fontsize=8, title_fontsize=8, loc="center left",
               bbox_to_anchor=(1.0, 0.5))
    fig.suptitle(f"Per-position acceptance rate: {results['drafter']['name']} drafter variants "
                 f"(target {results['target']['variant']}, greedy)")
    fig.tight_layout()
    return save_png(fig, path, dpi=120, tight=True)
