"""Safe loading of the target: config and weights, safetensors only, one-sentence errors.

Weights are never unpickled: a local checkpoint must hold `*.safetensors` (a directory with only
`pytorch_model.bin` / `*.pt` is refused), Hub checkpoints are loaded with `use_safetensors=True`,
and every local safetensors header is read before the model is built, so a truncated file is named
instead of failing deep inside transformers. `trust_remote_code` stays off unless configured.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.core.errors import bad_value
from pipeline.core.hub import hub_id
from pipeline.core.io import hash_files, in_hf_local_cache, list_files

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
CONFIG_FILES = ("config.json",)  # with the weights, what decides a checkpoint's outputs


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
    check_shard_index(p, field)
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                fh.keys()
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise bad_value(field, str(f), f"the safetensors file is unreadable ({str(exc).splitlines()[0]})",
                            "re-download or re-save the checkpoint") from None
    return files


def check_shard_index(path: Path, field: str) -> None:
    """A sharded checkpoint (`*.safetensors.index.json`): every shard its weight_map names is present."""
    import json

    for index in sorted(path.glob("*.safetensors.index.json")):
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            shards = sorted(set(weight_map.values()))
            if not all(isinstance(x, str) for x in shards):
                raise TypeError("a weight_map value is not a file name")
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise bad_value(field, str(path), f"its {index.name} is not a valid shard index "
                            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
                            "re-download or re-save the checkpoint") from None
        missing = [x for x in shards if not (path / x).is_file()]
        if missing:
            more = f" (and {len(missing) - 1} more of its {len(shards)} shards)" if len(missing) > 1 else ""
            raise bad_value(field, str(path), f"its {index.name} lists {missing[0]}{more}, which is missing "
                            f"from {path}", "re-download the checkpoint or copy the missing shard into that "
                            "directory")


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


def load_target(path: str | Path, *, dtype, revision: str | None = None, trust_remote_code: bool = False,
                attn_implementation: str | None = None, device=None, auto_cls=None, field: str = "target.path",
                **kwargs):
    """The one way a target's weights are loaded: `auto_cls.from_pretrained` (default
    `AutoModelForCausalLM`; the cache stage takes the base `AutoModel`) with safetensors only, after its
    config (`trust_remote_code` named when needed) and every local safetensors header and shard index
    are checked, so a bad checkpoint is one sentence naming `field` before any weight is read.

    `dtype`, `attn_implementation` (None: transformers' default) and the rest of `kwargs` (`device_map`,
    `max_memory`, `quantization_config`, ...) go to `from_pretrained`; with `device` the model is moved
    there. Returned in eval mode."""
    if auto_cls is None:
        from transformers import AutoModelForCausalLM as auto_cls
    load_config(str(path), revision, trust_remote_code, field)  # config / trust_remote_code errors first
    check_safetensors_dir(path, field)
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = auto_cls.from_pretrained(str(path), revision=revision, use_safetensors=True, dtype=dtype,
                                     trust_remote_code=bool(trust_remote_code), **kwargs)
    return (model if device is None else model.to(device)).eval()


# ---------------------------------------------------------------- input hashes
def local_snapshot(path: str | Path, revision: str | None = None, partial_ok: bool = False) -> Path:
    """A local directory as it is; a Hub repo id at `revision` (None = main) -> its snapshot folder in
    the local Hub cache. Offline only: nothing is ever downloaded. Raises LookupError (with the reason)
    when `path` is neither. `partial_ok` accepts a snapshot the Hub client knows to be incomplete
    (e.g. only the tokenizer files of a repo were fetched)."""
    if Path(path).is_dir():
        return Path(path)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError

    try:
        return Path(snapshot_download(str(path), revision=revision, local_files_only=True))
    except IncompleteSnapshotError as exc:
        if partial_ok:
            return Path(exc.snapshot_path)
        raise LookupError(str(exc).splitlines()[0]) from None
    except Exception as exc:  # noqa: BLE001 - not a repo id, or not in the cache: told apart in the sentence
        if hub_id(str(path)):
            raise LookupError(f"it is not in the local Hugging Face cache ({str(exc).splitlines()[0]})") from None
        raise LookupError(f"it is neither a directory nor a cached Hub repo ({str(exc).splitlines()[0]})") from None


def download_hint(path: str, revision: str | None = None, repo_type: str = "model") -> str:
    """The fix for a Hub id that is not on this machine: the `hf download` command that fetches it (pinned
    to `revision` when one is set) into `downloads/<name>`, and the key to point at that directory."""
    rev = f" --revision {revision}" if revision and revision != "main" else ""
    kind = " --repo-type dataset" if repo_type == "dataset" else ""
    return f"download it with `hf download {path}{kind}{rev} --local-dir downloads/{str(path).rsplit('/', 1)[-1]}`"


def is_checkpoint_file(rel: str, weights_only: bool = False) -> bool:
    """The files that decide a checkpoint's outputs: top-level `*.safetensors` (+ their index) and
    config.json (`weights_only` leaves the config out). Never the Hub client's own metadata."""
    if "/" in rel or in_hf_local_cache(rel):
        return False
    return rel.endswith((".safetensors", ".safetensors.index.json")) or (not weights_only and rel in CONFIG_FILES)


def checkpoint_hashes(path: str | Path, revision: str | None = None,
                      weights_only: bool = False) -> dict[str, dict[str, Any]] | None:
    """{file: {"sha256", "bytes"}} of a model directory's weight + config files, sorted, or None when
    `path` is neither a directory nor a Hub repo already in the local cache (nothing is downloaded).
    Symlinks are followed: a Hub snapshot's files are links into its blobs."""
    try:
        root = local_snapshot(path, revision)
    except LookupError:
        return None
    rels = list_files(root, lambda rel: not is_checkpoint_file(rel, weights_only), follow_links=True)
    return hash_files(root, rels, desc=f"hashing {path}")


def checkpoint_sha256(path: str | Path, revision: str | None = None, weights_only: bool = False) -> dict[str, str]:
    """{file: sha256} of `checkpoint_hashes`, {} when the checkpoint is not available locally."""
    return {rel: e["sha256"] for rel, e in (checkpoint_hashes(path, revision, weights_only) or {}).items()}
