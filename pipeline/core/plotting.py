"""PNG plots that are byte-stable: matplotlib's Agg backend, no version or date in the file.

Every plot of the pipeline (evaluation report, quantization checks) is saved through `save_png`,
so the same numbers always give the same bytes (and the same sha256 in the manifests).
"""

from __future__ import annotations

import io
from pathlib import Path

from pipeline.core.io import atomic_write_bytes

PNG_METADATA = {"Software": None}  # matplotlib would write its version here


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: str | Path, dpi: int = 120, tight: bool = False) -> Path:
    """Render `fig` to PNG with fixed metadata, write it atomically and close the figure."""
    path = Path(path)
    try:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=dpi, metadata=PNG_METADATA, bbox_inches="tight" if tight else None)
    finally:
        pyplot().close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return path
