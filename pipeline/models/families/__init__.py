"""Drafter families: one module per drafter algorithm, each registering one `DrafterFamily` (`base.py`).

    from pipeline.models import families
    fam = families.family_of(config)      # a config.json dict or a parsed drafter config -> DrafterFamily
    fam = families.get("dflash")          # by name; families.names() lists them
    fam.serve_mode, fam.card_name, fam.dense_linears(dconf), fam.vllm_quantized_linears(config, T, prof), ...

Built in: `dflash` (`dflash.py`) and `dflash2` (`dflash2.py`, extending it). A new family is one module here that
subclasses `DrafterFamily` (or a family it extends) and calls `register`, plus its import below
(docs/ARCHITECTURE.md, "A drafter family"). Torch-free: the classes are imported when a family is asked for them.
"""

from __future__ import annotations

from pipeline.models.families import dflash, dflash2  # noqa: F401 - registers the built-in families, in order
from pipeline.models.families.base import (
    SERVE_MODES,
    DrafterFamily,
    families,
    family_of,
    find,
    get,
    names,
    register,
    unregister,
)

__all__ = ["SERVE_MODES", "DrafterFamily", "families", "family_of", "find", "get", "names", "register",
           "unregister"]
