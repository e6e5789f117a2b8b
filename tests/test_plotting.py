"""Every PNG of the pipeline goes through pipeline.core.plotting.save_png: same figure -> same bytes."""

from __future__ import annotations

from pipeline.core.plotting import pyplot, save_png


def _figure():
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.bar([0, 1, 2], [1.0, 2.5, 1.7])
    return fig


def test_png_bytes_are_stable_and_carry_no_version(tmp_path):
    plt = pyplot()
    a = save_png(_figure(), tmp_path / "a.png", dpi=80, tight=True)
    b = save_png(_figure(), tmp_path / "b.png", dpi=80, tight=True)
    assert a.read_bytes() == b.read_bytes() and a.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert b"matplotlib" not in a.read_bytes().lower()  # no "Software: matplotlib version ..." chunk
    assert plt.get_fignums() == []  # closed after saving
    assert {p.name for p in tmp_path.iterdir()} == {"a.png", "b.png"}  # no temp file left


def test_checks_and_report_plots_use_it(tmp_path):
    from pipeline.evaluation import plots
    from pipeline.quant import checks

    checks.plot_errors({"layers.0.mlp.down_proj": 0.02, "layers.0.mlp.up_proj": 0.05}, "t", tmp_path / "e.png")
    first = (tmp_path / "e.png").read_bytes()
    checks.plot_errors({"layers.0.mlp.down_proj": 0.02, "layers.0.mlp.up_proj": 0.05}, "t", tmp_path / "e.png")
    assert (tmp_path / "e.png").read_bytes() == first and b"matplotlib" not in first.lower()
    assert plots.save_png is save_png and pyplot().get_fignums() == []
