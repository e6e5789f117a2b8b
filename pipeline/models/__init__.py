"""Drafter and target families: the DFlash drafter (model, formats, compatibility checks, speculative decoding), the
drafter-family registry (`pipeline.models.families`), the target families (`targets`) and `checkpoint_info`.

Kept import-light (no torch here) so `pipeline.models.layout` / `compat` answer in well under a
second; `DFlashConfig` is registered with `AutoConfig` when `pipeline.models.dflash` is imported.
"""

from __future__ import annotations

__all__ = ["DFlashConfig", "DFlashDrafter"]


def __getattr__(name: str):
    if name in __all__:
        from pipeline.models import dflash

        return getattr(dflash, name)
    raise AttributeError(name)
