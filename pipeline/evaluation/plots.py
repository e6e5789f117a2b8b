"""PNG plots for the evaluation report (and later the model card).

Saved with `pipeline.core.plotting.save_png` (Agg backend, no version or timestamp metadata), so the
same results give the same bytes.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.core.plotting import pyplot, save_png

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


def calibration_pairs(results: dict, path: Path) -> Path | None:
    """Calibrated vs data-free per scheme: held-apart layer-output error, top-1 vs bf16 and tau, side by side."""
    rows = results.get("calibration_comparison") or []
    if not rows:
        return None
    plt = pyplot()
    labels = [f"{r['calibrated']}\nvs {r['calibration_free']}" for r in rows]
    panels = [("layer-output error (held-apart, mean)", "layer_output_error_heldout"),
              ("top-1 vs bf16 drafter (held-apart)", "top1_heldout"), ("acceptance length τ (all)", "tau")]
    fig, axes = plt.subplots(1, 3, figsize=(4.2 * 3, 3.8), squeeze=False)
    xs = range(len(rows))
    for ax, (title, key) in zip(axes[0], panels):
        cal, free = [], []
        for r in rows:
            if key == "layer_output_error_heldout":
                errs = r.get(key) or {}
                a, b = ((errs.get(v) or {}).get("mean") for v in (r["calibrated"], r["calibration_free"]))
            elif key == "top1_heldout":
                t = r.get(key) or {}
                a, b = t.get("top1_a"), t.get("top1_b")
            else:
                a, b = r["tau"]["calibrated"], r["tau"]["calibration_free"]
            cal.append(float("nan") if a is None else a)
            free.append(float("nan") if b is None else b)
        b1 = ax.bar([x - 0.2 for x in xs], free, width=0.38, label="data-free / calibration-free", color="#bbbbbb")
        b2 = ax.bar([x + 0.2 for x in xs], cal, width=0.38, label="calibrated", color="#4c72b0")
        for bars in (b1, b2):
            ax.bar_label(bars, fmt="%.3g", fontsize=7, padding=1)
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="upper right")
    fig.suptitle(f"Calibration on the target's hidden states vs data-free: {results['drafter']['name']} "
                 f"(verdicts in report.md)", fontsize=10)
    fig.tight_layout()
    return save_png(fig, path, dpi=120, tight=True)


def pair_matrix(results: dict, path: Path) -> Path | None:
    """Heatmap: τ (all prompts) of every drafter variant (rows) with every target variant (columns)."""
    matrix = (results.get("pairs") or {}).get("matrix") or {}
    if len(matrix) < 2:
        if path.exists():
            path.unlink()
        return None
    plt = pyplot()
    targets = list(matrix)
    drafters = list(matrix[targets[0]])
    values = [[matrix[t][v]["overall"]["tau"] if v in matrix[t] else float("nan") for t in targets] for v in drafters]
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(targets), 1.2 + 0.45 * len(drafters)))
    im = ax.imshow(values, cmap="viridis", aspect="auto")
    for i, row in enumerate(values):
        for j, x in enumerate(row):
            ax.text(j, i, f"{x:.3f}", ha="center", va="center", fontsize=8,
                    color="white" if x < (min(min(r) for r in values) + max(max(r) for r in values)) / 2 else "black")
    ax.set_xticks(range(len(targets)), [f"target {t}" for t in targets])
    ax.set_yticks(range(len(drafters)), [f"{v} (cal. {matrix[targets[0]][v].get('calibration_target') or '-'})"
                                         for v in drafters], fontsize=8)
    fig.colorbar(im, ax=ax, label="acceptance length τ")
    ax.set_title(f"τ of every drafter x target pair\n{results['drafter']['name']} drafter, greedy, "
                 f"block size {results['block_size']}", fontsize=9)
    return save_png(fig, path, dpi=120, tight=True)
