"""Import speculators' hidden-state files into this project's cache format.

speculators (offline data generation, e.g. with vLLM elsewhere) writes one `hs_{i}.safetensors`
per sample, holding `token_ids` [T] and `hidden_states` [T, n_layers, H]; its prepared dataset
(`datasets.save_to_disk`) holds the matching `input_ids` and `loss_mask` rows. This command keeps
the layers the drafter reads and writes the same shards + index.json as the cache stage, so
`CacheReader` and every later stage use an imported cache unchanged.

    python -m pipeline cache-import SRC OUT --file-layer-ids 2 18 33 36 --aux-layer-ids 2 18 33 \
        --dataset path/to/prepared_dataset
"""

from __future__ import annotations

import argparse
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pipeline.artifacts.cache import (
    Layout,
    build_index,
    check_storage_dtype,
    clear_stale,
    encode_hidden,
    plan_shards,
)
from pipeline.artifacts.cache_writer import ShardWriter
from pipeline.core.errors import SpecquantError, bad_value
from pipeline.core.io import dumps_json, remove_stale_temps, sha256_bytes, sha256_text

_HS_RE = re.compile(r"^hs_(\d+)\.safetensors$")


def find_hs_files(src: Path) -> list[Path]:
    files = sorted(((int(m.group(1)), p) for p in src.iterdir() if (m := _HS_RE.match(p.name))),
                   key=lambda t: t[0]) if src.is_dir() else []
    if not files:
        raise bad_value("src", str(src), "it holds no hs_{i}.safetensors files",
                        "point it at speculators' hidden-state output directory")
    return [p for _, p in files]


def load_loss_masks(dataset: str | Path) -> tuple[list[list[int]], list[list[int]] | None]:
    """loss_mask (and input_ids when present) rows of speculators' prepared dataset."""
    from datasets import load_from_disk

    try:
        ds = load_from_disk(str(dataset))
    except Exception as exc:  # noqa: BLE001 - any failure means the same thing to the user
        raise bad_value("dataset", str(dataset), f"it is not a dataset saved with save_to_disk ({exc})",
                        "give the prepared dataset directory speculators wrote") from None
    if "loss_mask" not in ds.column_names:
        raise bad_value("dataset", str(dataset), f"it has no loss_mask column (columns: {ds.column_names})",
                        "give the prepared dataset that speculators' data generation used")
    ids = ds["input_ids"] if "input_ids" in ds.column_names else None
    return [list(map(int, m)) for m in ds["loss_mask"]], (None if ids is None else [list(map(int, r)) for r in ids])


def _header_lengths(files: list[Path]) -> tuple[list[int], int, int]:
    from safetensors import safe_open

    lengths, shapes = [], set()
    for p in files:
        with safe_open(str(p), framework="pt") as f:
            if not {"token_ids", "hidden_states"} <= set(f.keys()):
                raise bad_value("src", str(p), "it lacks token_ids or hidden_states",
                                "give speculators' hs_{i}.safetensors files")
            shape = f.get_slice("hidden_states").get_shape()
            lengths.append(int(f.get_slice("token_ids").get_shape()[0]))
            if len(shape) != 3 or shape[0] != lengths[-1]:
                raise bad_value("src", str(p), f"hidden_states has shape {shape}, not [T, n_layers, H] with "
                                f"T = {lengths[-1]} tokens", "give speculators' hs_{i}.safetensors files")
            shapes.add(tuple(shape[1:]))
    if len(shapes) != 1:
        raise bad_value("src", str(files[0].parent), f"its files disagree on [n_layers, H]: {sorted(shapes)}",
                        "import one generation run at a time")
    n_layers, hidden = shapes.pop()
    return lengths, int(n_layers), int(hidden)


def _token_ids(path: Path) -> list[int]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor("token_ids").long().tolist()


def import_speculators(src: str | Path, out: str | Path, file_layer_ids: list[int], aux_layer_ids: list[int] | None = None,
                       loss_masks: list[list[int]] | str | Path | None = None, storage_dtype: str = "bfloat16",
                       samples_per_shard: int = 64, max_shard_bytes: int = 2 * 1024**3,
                       id_prefix: str = "speculators") -> dict:
    """Write a cache at `out` from `src`/hs_{i}.safetensors; returns the index.

    `file_layer_ids` are the HF output_hidden_states indices of the files' n_layers axis (in order);
    `aux_layer_ids` (default: all of them) are the ones kept, in the order given. `loss_masks` is a
    prepared dataset directory (its `loss_mask` column, row i for hs_i) or a list of masks."""
    src, out = Path(src), Path(out)
    check_storage_dtype(storage_dtype)
    files = find_hs_files(src)
    lengths, n_layers, hidden = _header_lengths(files)
    file_layer_ids = [int(m) for m in file_layer_ids]
    if len(file_layer_ids) != n_layers:
        raise bad_value("file_layer_ids", file_layer_ids, f"the files hold {n_layers} layers",
                        f"give {n_layers} HF layer indices, one per stored layer, in file order")
    aux = [int(m) for m in (aux_layer_ids or file_layer_ids)]
    missing = [m for m in aux if m not in file_layer_ids]
    if missing or len(set(aux)) != len(aux):
        raise bad_value("aux_layer_ids", aux, f"layer {missing[0] if missing else aux} is not stored once in the "
                        f"files (they hold {file_layer_ids})", "choose aux layers among the stored ones")
    pos = [file_layer_ids.index(m) for m in aux]
    ref_ids = None
    if isinstance(loss_masks, str | Path):
        loss_masks, ref_ids = load_loss_masks(loss_masks)
    if loss_masks is None or len(loss_masks) != len(files):
        raise bad_value("loss_masks", None if loss_masks is None else f"{len(loss_masks)} rows",
                        f"one loss mask per hs file is needed ({len(files)} files)",
                        "pass speculators' prepared dataset (or a list of masks) with one row per file")
    layout = Layout(tuple(aux), hidden, storage_dtype)
    plans = plan_shards(lengths, layout, samples_per_shard, max_shard_bytes)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)
    clear_stale(out, resume_key="", num_shards=0)  # an import always rewrites every shard
    key = sha256_text(dumps_json({"src": [[p.name, n] for p, n in zip(files, lengths, strict=True)], "aux": aux,
                                  "storage_dtype": storage_dtype, "plan": [[p.first, p.count] for p in plans]}))
    samples: list[dict] = [{} for _ in files]
    file_hashes: list[str] = []
    from safetensors.torch import load as st_load
    from tqdm import tqdm

    with ThreadPoolExecutor(1) as pool, ThreadPoolExecutor(1) as io_pool, tqdm(total=sum(lengths), unit="tok", unit_scale=True, desc="import") as bar:
        for plan in plans:
            rng = range(plan.first, plan.first + plan.count)
            for g in rng:  # token ids first (small), so the shard header and id block can be written
                ids = _token_ids(files[g])
                mask = [int(v) for v in loss_masks[g]]
                if len(mask) != len(ids) or (ref_ids is not None and ref_ids[g][: len(ids)] != ids):
                    raise SpecquantError(f"{files[g].name} does not match row {g} of the loss masks / prepared "
                                         "dataset (different tokens or length); import the dataset that generated "
                                         "these files.")
                samples[g] = {"id": f"{id_prefix}/{g}", "input_ids": ids, "loss_mask": mask}
            writer = ShardWriter(out, plan, list(rng), samples, layout, key, pool, io_pool)
            try:
                for g in rng:  # one file in memory at a time; its hash and tensors come from the same bytes
                    raw = files[g].read_bytes()
                    file_hashes.append(sha256_bytes(raw))
                    hs, scale = encode_hidden(st_load(raw)["hidden_states"][:, pos, :], layout)
                    del raw
                    writer.add(g, hs, scale)
                    writer.drain()
                    bar.update(lengths[g])
                writer.close()
            except BaseException:
                writer.abort()
                raise
    inputs = {"format_version": 1, "source": "speculators", "aux_layer_ids": aux, "storage_dtype": storage_dtype,
              "file_layer_ids": file_layer_ids, "hs_files_sha256": sha256_text("\n".join(file_hashes)),
              "loss_masks_sha256": sha256_text(dumps_json(loss_masks))}
    return build_index(out, plans, layout, inputs, sha256_text(dumps_json(inputs)), key,
                       {"imported_from": str(src)})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline cache-import", description=(
        "Import speculators hidden-state files (hs_{i}.safetensors: token_ids [T], hidden_states "
        "[T, n_layers, H]) into a specquant cache directory (index.json + shard-NNNNN.safetensors)."))
    ap.add_argument("src", help="directory holding hs_0.safetensors, hs_1.safetensors, ...")
    ap.add_argument("out", help="cache directory to write, e.g. runs/<name>/cache")
    ap.add_argument("--file-layer-ids", type=int, nargs="+", required=True,
                    help="HF output_hidden_states index of each stored layer, in file order")
    ap.add_argument("--aux-layer-ids", type=int, nargs="+", default=None,
                    help="layers to keep, in the drafter's order (default: all stored layers)")
    ap.add_argument("--dataset", required=True,
                    help="speculators' prepared dataset directory (save_to_disk) with a loss_mask column")
    ap.add_argument("--storage-dtype", default="bfloat16", help="bfloat16 | float16 | float32 | fp8")
    ap.add_argument("--samples-per-shard", type=int, default=64)
    ap.add_argument("--max-shard-bytes", type=int, default=2 * 1024**3)
    a = ap.parse_args(argv)
    try:
        index = import_speculators(a.src, a.out, a.file_layer_ids, a.aux_layer_ids, a.dataset, a.storage_dtype,
                                   a.samples_per_shard, a.max_shard_bytes)
    except SpecquantError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"[specquant] imported {index['num_samples']} samples, {index['num_tokens']} tokens into {a.out} "
          f"(content {index['content_hash'][:12]}...)")
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["import_speculators", "main", "find_hs_files", "load_loss_masks"]
