"""Writing quantized checkpoints: whole directories appear atomically, byte-stable on re-runs.

A checkpoint is assembled in a sibling `.partial-*` directory (every file fsynced), then renamed
over the destination; a killed run leaves only a partial directory that the next run removes.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from pipeline.core import quiet
from pipeline.core.io import atomic_write_json, hash_tree

# files a tokenizer directory may hold; copied beside a quantized target so `vllm serve <dir>` works
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "added_tokens.json", "tokenizer.model", "generation_config.json")


def save_compressed(model, out_dir: Path, writer: bool = True) -> dict | None:
    """Compress with compressed-tensors and save (model.safetensors, config.json, recipe.yaml).

    Uses the save_pretrained that oneshot wrapped; it re-reads config.json from
    `model.config.name_or_path`, so that directory must still exist. Returns the written config.
    Under torchrun every rank must call it (compression is split across ranks) but only rank 0
    writes: the others pass writer=False and get None.
    """
    # llm-compressor dispatches the model with an hf_device_map naming "cpu" (its offload wrapper, also on
    # a GPU run once calibration is done), so transformers warns "Attempting to save a model with offloaded
    # modules. Ensure that unallocated cpu memory exceeds the `shard_size` (50GB default)": the weights are
    # already in CPU memory and one file is written by design (max_shard_size above), so there is nothing
    # to act on; llm-compressor's "No accelerator available!" during compression is muted as in
    # pipeline.quant.calibrate.run_oneshot
    with quiet.warnings_ignored("Attempting to save a model with offloaded modules"), \
            quiet.loguru_muted("llmcompressor.utils.dev"):
        model.save_pretrained(str(out_dir), save_compressed=True, max_shard_size="1000GB")
    recipe = out_dir / "recipe.yaml"
    if writer and recipe.is_file():
        text = recipe.read_text(encoding="utf-8")
        plain = plain_recipe(text)
        if plain != text:
            recipe.write_text(plain, encoding="utf-8")
    return json.loads((out_dir / "config.json").read_text(encoding="utf-8")) if writer else None


def plain_recipe(text: str) -> str:
    """recipe.yaml as plain data: llm-compressor writes Python object tags for enums (GPTQ's
    `actorder: !!python/object/apply:...ActivationOrdering [static]`), which a safe YAML loader (the
    manifest's, the Hub's, a user's) refuses. Each such value becomes what it stands for (the enum's
    value); a recipe without tags is returned unchanged, byte for byte."""
    import yaml

    if "!!python/" not in text:
        return text

    class _Loader(yaml.SafeLoader):
        pass

    def apply(loader, suffix, node):
        if isinstance(node, yaml.SequenceNode):
            args = loader.construct_sequence(node, deep=True)
        elif isinstance(node, yaml.MappingNode):
            args = list(loader.construct_mapping(node, deep=True).get("args") or [])
        else:
            args = [loader.construct_scalar(node)]
        return args[0] if len(args) == 1 else args

    def obj(loader, suffix, node):
        if isinstance(node, yaml.MappingNode):
            return loader.construct_mapping(node, deep=True)
        return loader.construct_scalar(node) if isinstance(node, yaml.ScalarNode) else loader.construct_sequence(node)

    _Loader.add_multi_constructor("tag:yaml.org,2002:python/object/apply:", apply)
    _Loader.add_multi_constructor("tag:yaml.org,2002:python/object/new:", apply)
    _Loader.add_multi_constructor("tag:yaml.org,2002:python/", obj)
    data = yaml.load(text, Loader=_Loader)  # noqa: S506 - the loader only builds plain values
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def copy_tokenizer(src: str | os.PathLike, out_dir: Path) -> list[str]:
    src = Path(src)
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out_dir / name)
            copied.append(name)
    return copied


def rewrite_config(out_dir: Path, config: dict) -> None:
    """Replace config.json with canonical JSON (sorted keys) so re-runs are byte-identical."""
    atomic_write_json(out_dir / "config.json", config)


def output_hashes(out_dir: Path) -> dict[str, str]:
    return {k: v["sha256"] for k, v in hash_tree(out_dir).items()}


STREAM_CHUNK_BYTES = 64 << 20  # host bytes in flight while a tensor is written


def save_safetensors(tensors: dict, path: Path, metadata: dict[str, str] | None = None,
                     dtype=None) -> None:
    """Atomically write `tensors` as the bytes `safetensors.torch.save(tensors, metadata)` returns, one
    tensor (and, from an accelerator, one slice of it) at a time: the host never holds the whole file,
    nor the tensors whole. With `dtype`, floating tensors are cast first (on their own device).

    The layout is safetensors': the header JSON (`__metadata__`, then the tensors in data order), padded
    with spaces to 8 bytes, then the data back to back; the data order (dtype, then name) is read from
    safetensors itself, on one-value stand-ins (tests/test_quant_drafter.py compares both writers)."""
    import struct

    import torch
    from safetensors.torch import save as st_save

    from pipeline.core.io import HashingWriter, atomic_open

    def cast(t):
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    specs = {k: (dtype if dtype is not None and v.is_floating_point() else v.dtype, tuple(v.shape), v.numel())
             for k, v in tensors.items()}
    probe = st_save({k: torch.zeros(1, dtype=d) for k, (d, _, _) in specs.items()})
    n = struct.unpack("<Q", probe[:8])[0]
    probed = json.loads(probe[8:8 + n])
    order = [k for k in probed if k != "__metadata__"]  # json keeps the header's order
    header: dict = {}
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for k in order:
        d, shape, numel = specs[k]
        size = numel * torch.empty((), dtype=d).element_size()
        header[k] = {"dtype": probed[k]["dtype"], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    head += b" " * ((8 - len(head) % 8) % 8)
    with atomic_open(path, "wb") as fh:
        out = HashingWriter(fh)
        out.write(struct.pack("<Q", len(head)))
        out.write(head)
        for k in order:
            flat = tensors[k].detach().reshape(-1)
            step = max(1, STREAM_CHUNK_BYTES // max(1, flat.element_size()))
            for i in range(0, flat.numel(), step):
                part = cast(flat[i:i + step]).contiguous().cpu()
                out.write(memoryview(part.view(torch.uint8).numpy()))

