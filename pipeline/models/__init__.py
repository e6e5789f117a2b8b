"""The DFlash drafter (model, formats, compatibility checks, speculative decoding).

Importing this package registers `DFlashConfig` with `AutoConfig`.
"""

from pipeline.models.dflash import DFlashConfig, DFlashDrafter

__all__ = ["DFlashConfig", "DFlashDrafter"]
