"""What the drafter check reports about activation scales: held-apart QDQ errors, their summary, the plot.

The search (`pipeline.quant.act_scale`) picks each activation-quantized Linear's scale on calibration batches;
this module holds how `pipeline.quant.drafter_checks` then judges the stored scales: `HeldoutErrors` (the same
layer-output error, `act_scale.LayerError`, on held-apart batches, the checkpoint's scale against the
calibration-free fixed one), `summarize` (mean relative error per key) and `plot` (per layer, the error change
against the fixed scale). Kept apart from the search so that `act_scale.py` holds the search and the scales it
writes; it imports `act_scale`, never the other way round.
"""

from __future__ import annotations

from pipeline.quant.act_scale import LayerError, _f32, activation_quantized


class HeldoutErrors:
    """Activation-QDQ error on held-apart batches: the checkpoint's stored scale vs the fixed one.

    Inputs come from the dense reference drafter's forward (as in calibration): `attach` hooks its
    Linears, so the check's own reference forward feeds them (pipeline.quant.drafter_checks.compare);
    args and scales come from the reloaded checkpoint; W is the reference's dense weight.
    """

    def __init__(self, reference, quantized, fixed: float):
        self.ref_modules = dict(reference.named_modules())
        self.layers = {}
        for name, m in activation_quantized(quantized).items():
            stored = _f32(float(m.input_global_scale.reshape(-1)[0]))
            scales = [("calibrated", stored)] + ([("fixed", _f32(fixed))] if _f32(fixed) != stored else [])
            self.layers[name] = LayerError(self.ref_modules[name].weight, m.quantization_scheme.input_activations,
                                           scales)

    def attach(self) -> list:
        return [self.ref_modules[name].register_forward_pre_hook(layer.hook) for name, layer in self.layers.items()]

    def result(self) -> dict[str, dict]:
        out = {}
        for name, layer in self.layers.items():
            cal = layer.relative(0)
            fix = layer.relative(1) if len(layer.scales) > 1 else cal
            out[name] = {"calibrated_scale": layer.scales[0], "rows": layer.rows,
                         "relative_error": {"calibrated": cal, "fixed": fix}}
        return out


def summarize(record: dict[str, dict], keys: tuple[str, ...]) -> dict[str, float]:
    """Mean relative error over layers per key, and how many layers each key wins or ties."""
    layers = list(record.values())
    if not layers:
        return {}
    out = {f"mean_relative_error_{k}": sum(r["relative_error"][k] for r in layers) / len(layers) for k in keys}
    out["layers"] = len(layers)
    return out


_COLORS = {"minmax": "#8c8c8c", "chosen": "#2ca02c", "calibrated": "#2ca02c"}


def plot(search_record: dict | None, heldout: dict | None, title: str, path) -> None:
    """Per layer, activation-QDQ error relative to the calibration-free fixed scale (0 = as good as it,
    negative = better): calibration data (minmax, chosen) and held-apart data (calibrated). PNG with
    fixed metadata."""
    from pipeline.core.plotting import pyplot, save_png

    plt = pyplot()
    panels = [(t, rec, keys) for t, rec, keys in
              [("calibration samples", (search_record or {}).get("layers"), ("minmax", "chosen")),
               ("held-apart samples", heldout, ("calibrated",))] if rec]
    names = list(panels[0][1])
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 0.3 * len(names) + 1.6), squeeze=False,
                             sharey=True)
    for ax, (sub, rec, keys) in zip(axes[0], panels):
        h = 0.8 / len(keys)
        for j, k in enumerate(keys):
            ys = [i + (j - (len(keys) - 1) / 2) * h for i in range(len(names))]
            change = [100 * (rec[n]["relative_error"][k] / rec[n]["relative_error"]["fixed"] - 1)
                      if rec[n]["relative_error"]["fixed"] > 0 else 0.0 for n in names]
            ax.barh(ys, change, height=h * 0.95, label=k, color=_COLORS[k])
        ax.axvline(0.0, color="#d62728", lw=1.0, label="fixed (calibration-free)")
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.set_xlabel("error change vs the fixed scale, %  (error = ||(Q(x) - x) W^T||^2)", fontsize=8)
        ax.set_title(sub, fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(axis="x", alpha=0.3)
    axes[0][0].invert_yaxis()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_png(fig, path, dpi=100)
