"""Safe loading of the target: config and weights, safetensors only, one-sentence errors.

Weights are never unpickled: a local checkpoint must hold `*.safetensors` (a directory with only
`pytorch_model.bin` / `*.pt` is refused), Hub checkpoints are loaded with `use_safetensors=True`,
and every local safetensors header is read before the model is built, so a truncated file is named
instead of failing deep inside transformers. `trust_remote_code` stays off unless configured.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import bad_value

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def check_safetensors_dir(path: str | Path, field: str) -> list[Path]:
    """For a local checkpoint directory: its safetensors files, each with a readable header."""
    from safetensors import safe_open

    p = Path(path)
    if not p.is_dir():
        return []
    files = sorted(p.glob("*.safetensors"))
    if not files:
        pickles = sorted(x.name for x in p.iterdir() if x.suffix in PICKLE_SUFFIXES)
        what = f"it holds only pickle weights ({', '.join(pickles)})" if pickles else "it holds no *.safetensors weights"
        raise bad_value(field, str(path), f"{what}, and specquant never unpickles weights",
                        "convert the checkpoint to safetensors (e.g. save_pretrained(safe_serialization=True))")
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                fh.keys()
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise bad_value(field, str(f), f"the safetensors file is unreadable ({str(exc).splitlines()[0]})",
                            "re-download or re-save the checkpoint") from None
    return files


def load_config(path: str, revision: str | None, trust_remote_code: bool, field: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=bool(trust_remote_code))
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise bad_value(f"{field.rsplit('.', 1)[0]}.trust_remote_code", bool(trust_remote_code),
                            f"{path} needs custom code to load", "set it to true only if you trust that code, "
                            "or use a checkpoint with a standard architecture") from None
        raise bad_value(field, path, f"its config cannot be read ({str(exc).splitlines()[0]})",
                        "point it at a model directory or Hub repo with a valid config.json") from None
    except OSError as exc:
        raise bad_value(field, path, f"its config cannot be read ({str(exc).splitlines()[0]})",
                        "point it at a model directory or Hub repo with config.json") from None


def target_config(target_cfg):
    return load_config(target_cfg.path, target_cfg.revision, target_cfg.trust_remote_code, "target.path")


def from_pretrained_safe(auto_cls, target_cfg, **kwargs):
    """`auto_cls.from_pretrained` on the configured target, refusing pickles and unreadable files first."""
    target_config(target_cfg)  # one-sentence errors for config / trust_remote_code before any weight I/O
    check_safetensors_dir(target_cfg.path, "target.path")
    return auto_cls.from_pretrained(target_cfg.path, revision=target_cfg.revision, use_safetensors=True,
                                    trust_remote_code=bool(target_cfg.trust_remote_code), **kwargs)
