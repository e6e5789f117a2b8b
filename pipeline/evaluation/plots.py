"""PNG plots for the evaluation report (and later the model card).

Saved with `pipeline.core.plotting.save_png` (Agg backend, no version or timestamp metadata), so the
same results give the same bytes.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.core.plotting import pyplot, save_png

_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_DASHES = ("-", "--", "-.", ":")


REFERENCE = "bf16"
_SUBSET_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860")
_SUBSET_MARKERS = ("o", "s", "^", "v", "P", "X")  # never the "all prompts" diamond


def _zoomed(lo: float, hi: float, pad: float = 0.15, include: float | None = None) -> tuple[float, float]:
    """Axis limits around the data (and `include`, e.g. 0), so differences of a few percent fill the axis."""
    if include is not None:
        lo, hi = min(lo, include), max(hi, include)
    span = (hi - lo) or max(abs(hi), 1e-3)
    return lo - pad * span, hi + pad * span


def tau_bars(results: dict, path: Path) -> Path:
    """τ per subset of every drafter variant as its change vs the bf16 drafter (%), one row per variant, sorted
    by the change over all prompts: a 1-5% difference fills the axis instead of hiding on a 0-8 scale. Without a
    bf16 reference, the absolute τ on an axis zoomed to the data."""
    plt = pyplot()
    ref = REFERENCE if REFERENCE in results["variants"] else None
    subsets = [s["name"] for s in results["subsets"]]

    def tau(v, s):
        d = results["variants"][v]
        return (d["overall"] if s == "all" else d["subsets"][s])["tau"]

    def value(v, s):
        return 100 * (tau(v, s) - tau(ref, s)) / tau(ref, s) if ref else tau(v, s)

    variants = [v for v in results["variant_order"] if v != ref]
    variants.sort(key=lambda v: (value(v, "all"), v))  # worst at the bottom, best at the top
    fig, ax = plt.subplots(figsize=(8.0, 1.6 + 0.42 * len(variants)))
    ys = range(len(variants))
    for j, s in enumerate(subsets):
        ax.scatter([value(v, s) for v in variants], [y + 0.18 * (j - (len(subsets) - 1) / 2) for y in ys], s=22,
                   marker=_SUBSET_MARKERS[j % len(_SUBSET_MARKERS)], color=_SUBSET_COLORS[j % len(_SUBSET_COLORS)],
                   label=s, zorder=3)
    alls = [value(v, "all") for v in variants]
    ax.scatter(alls, list(ys), s=70, marker="D", color="black", label="all prompts", zorder=4)
    unit = "%" if ref else ""
    right = ax.get_yaxis_transform()  # x in axes fraction, y in data: a column of values beside the plot
    for y, x, v in zip(ys, alls, variants):
        ax.text(1.01, y, f"{x:+.1f}{unit}  τ {tau(v, 'all'):.3f}" if ref else f"τ {x:.3f}", transform=right,
                fontsize=7, va="center")
    values = [value(v, s) for v in variants for s in [*subsets, "all"]] or [0.0]
    ax.set_xlim(*_zoomed(min(values), max(values), pad=0.25, include=0.0 if ref else None))
    if ref:
        ax.axvline(0.0, color="grey", lw=1.0)
    ax.set_yticks(list(ys), [f"{v}" for v in variants], fontsize=8)
    ax.set_ylim(-0.6, len(variants) - 0.4)
    ax.set_xlabel("τ change vs the bf16 drafter (%)" if ref else "acceptance length τ (axis zoomed to the data)")
    ref_txt = (", ".join(f"{s} {tau(ref, s):.3f}" for s in [*subsets, "all"])) if ref else ""
    ax.set_title(f"Acceptance length per subset: {results['drafter']['name']} drafter variants, target "
                 f"{results['target']['variant']}, greedy, block size {results['block_size']}"
                 + (f"\nbf16 drafter τ: {ref_txt}" if ref else ""), fontsize=9)
    ax.text(1.01, len(variants) - 0.45, "all prompts", transform=right, fontsize=7, va="bottom", weight="bold")
    ax.legend(title="subset", fontsize=7, title_fontsize=7, loc="upper center",
              bbox_to_anchor=(0.5, -0.55 / (0.42 * len(variants) + 0.6)), ncol=len(subsets) + 1)
    ax.grid(axis="x", alpha=0.3)
    return save_png(fig, path, dpi=120, tight=True)


def acceptance_curves(results: dict, path: Path) -> Path:
    """Per-position acceptance as small multiples: the bf16 drafter's P(position k accepted) per subset in the
    first panel, then one panel per variant with its difference from bf16 (percentage points) per subset, on one
    shared, zoomed axis, so no variant's curve hides another's."""
    plt = pyplot()
    ref = REFERENCE if REFERENCE in results["variants"] else None
    subsets = [s["name"] for s in results["subsets"]]
    positions = list(range(1, results["block_size"]))
    variants = [v for v in results["variant_order"] if v != ref]

    def rates(v, s):
        return results["variants"][v]["subsets"][s]["position_acceptance"]

    panels = ([ref] if ref else []) + variants
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.0 * cols + 1.2, 2.4 * rows + 0.8), squeeze=False)
    diffs = [100 * (a - b) for v in variants for s in subsets for a, b in zip(rates(v, s), rates(ref, s))] if ref \
        else []
    diffs = diffs or [0.0]  # the reference alone (evaluate on bf16 only) has no differences to scale the axis to
    lim = _zoomed(min(diffs), max(diffs), pad=0.1, include=0.0)
    for i, ax in enumerate(axes.flat):
        if i >= len(panels):
            ax.axis("off")
            continue
        v = panels[i]
        for j, s in enumerate(subsets):
            ys = rates(v, s) if (v == ref or not ref) else [100 * (a - b) for a, b in zip(rates(v, s), rates(ref, s))]
            ax.plot(positions, ys, marker=_SUBSET_MARKERS[j % len(_SUBSET_MARKERS)], ms=4,
                    color=_SUBSET_COLORS[j % len(_SUBSET_COLORS)], lw=1.3, label=s)
        if v == ref or not ref:
            ax.set_ylim(-0.02, 1.02)
            ax.set_title(f"{v}: P(position k accepted)", fontsize=8)
        else:
            ax.set_ylim(*lim)
            ax.axhline(0.0, color="grey", lw=0.8)
            ax.set_title(f"{v} minus bf16 (points)", fontsize=8)
        ax.set_xticks(positions)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if i + cols >= len(panels):
            ax.set_xlabel("draft position k", fontsize=7)
        if i % cols == 0:
            ax.set_ylabel("P(accepted)" if v == ref or not ref else "difference (points)", fontsize=7)
    handles, labels = axes[0][0].get_legend_handles_labels()
    spare = list(axes.flat)[len(panels):]
    if spare:  # in an empty cell of the grid, clear of every panel's title
        spare[0].legend(handles, labels, title="subset", fontsize=8, title_fontsize=8, loc="center")
    else:
        fig.legend(handles, labels, title="subset", fontsize=8, title_fontsize=8, loc="center left",
                   bbox_to_anchor=(1.0, 0.5))
    fig.suptitle(f"Per-position acceptance: {results['drafter']['name']} drafter variants "
                 f"(target {results['target']['variant']}, greedy); panels after the first: difference from bf16",
                 fontsize=9)
    fig.tight_layout()
    return save_png(fig, path, dpi=120, tight=True)


def calibration_pairs(results: dict, path: Path) -> Path | None:
    """Calibrated vs data-free per scheme, one row per pair (labels on the y axis, so they never overlap), one
    panel per measure: held-apart layer-output error, top-1 vs bf16, τ. Each pair is two dots joined by a line,
    on axes zoomed to the data."""
    rows = results.get("calibration_comparison") or []
    if not rows:
        return None
    plt = pyplot()
    labels = [f"{r['calibrated']}  vs  {r['calibration_free']}" for r in rows]
    panels = [("layer-output error (held-apart, mean)\nlower is better", "layer_output_error_heldout"),
              ("top-1 vs bf16 drafter (held-apart)\nhigher is better", "top1_heldout"),
              ("acceptance length τ (all prompts)\nhigher is better", "tau")]
    fig, axes = plt.subplots(1, 3, figsize=(12.5, 1.4 + 0.55 * len(rows)), sharey=True, squeeze=False)
    ys = list(range(len(rows)))[::-1]
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
        for y, a, b in zip(ys, cal, free):
            ax.plot([b, a], [y, y], color="#999999", lw=1.5, zorder=1)
        ax.scatter(free, ys, s=60, color="#bbbbbb", edgecolor="black", label="data-free / calibration-free", zorder=2)
        ax.scatter(cal, ys, s=60, color="#4c72b0", label="calibrated", zorder=3)
        for y, a, b in zip(ys, cal, free):
            for x, va in ((a, "bottom"), (b, "top")):
                if x == x:  # not NaN
                    ax.annotate(f"{x:.4g}", (x, y), xytext=(0, 6 if va == "bottom" else -6), textcoords="offset points",
                                ha="center", va=va, fontsize=7)
        finite = [x for x in cal + free if x == x] or [0.0]
        ax.set_xlim(*_zoomed(min(finite), max(finite), pad=0.2))
        ax.set_ylim(-0.7, len(rows) - 0.3)
        ax.set_title(title, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(axis="x", alpha=0.3)
    axes[0][0].set_yticks(ys, labels, fontsize=8)
    axes[0][0].legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12 if len(rows) > 2 else -0.25),
                      ncol=2)
    fig.suptitle(f"Calibration on the target's hidden states vs data-free: {results['drafter']['name']} "
                 f"(axes zoomed to the data; verdicts in report.md)", fontsize=10)
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
