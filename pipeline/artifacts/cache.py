"""The on-disk format of the hidden-state cache: layout, shard plan, sidecars, index, reader.

The writer side (streaming shard writer, background writer threads) is `pipeline.artifacts.cache_writer`.

Layout of `cache/` (see docs/cache_format.md):
    shard-NNNNN.safetensors   per-sample tensors `s<i>.input_ids|loss_mask|hidden_states[_scale]`
    shard-NNNNN.json          sidecar written after its shard: sha256, bytes, sample digests (resume state)
    index.json                written last, by rank 0: inputs hash, content hash, shards, samples

Shard boundaries depend only on the samples' lengths and the config, never on the number of
processes, so the same inputs give the same shards, the same index and the same content hash
whether one process or N wrote them.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.core.dtypes import TORCH_DTYPES
from pipeline.core.errors import SpecquantError, bad_value
from pipeline.core.io import atomic_write_json, read_json, sha256_file, sha256_text

FORMAT = "specquant-cache"
FORMAT_VERSION = 1
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# cache.storage_dtype: the model dtypes, and fp8 (E4M3 with a per-row scale)
STORAGE_DTYPES = {**{n: TORCH_DTYPES[n] for n in ("bfloat16", "float16", "float32")}, "fp8": torch.float8_e4m3fn}
_SHARD_RE = re.compile(r"^shard-(\d{5})\.(safetensors|json)$")


def shard_file(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def sidecar_file(k: int) -> str:
    return f"shard-{k:05d}.json"


@dataclass(frozen=True)
class Layout:
    """What one token's cached hidden states look like."""
    aux_layer_ids: tuple[int, ...]
    hidden_size: int
    storage_dtype: str  # a key of STORAGE_DTYPES

    @property
    def n_aux(self) -> int:
        return len(self.aux_layer_ids)

    @property
    def torch_dtype(self) -> torch.dtype:
        return STORAGE_DTYPES[self.storage_dtype]

    @property
    def fp8(self) -> bool:
        return self.storage_dtype == "fp8"

    def hidden_bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.torch_dtype).element_size()
        return self.n_aux * (self.hidden_size * elem + (4 if self.fp8 else 0))

    def sample_bytes(self, num_tokens: int) -> int:
        return num_tokens * (8 + 1 + self.hidden_bytes_per_token())


def check_storage_dtype(value: str) -> str:
    if value not in STORAGE_DTYPES:
        raise bad_value("cache.storage_dtype", value, "it is not a supported storage dtype",
                        f"use one of {', '.join(STORAGE_DTYPES)}")
    return value


@dataclass(frozen=True)
class ShardPlan:
    index: int
    first: int  # global index of its first sample
    count: int
    num_tokens: int
    tensor_bytes: int  # without the safetensors header


def plan_shards(lengths: list[int], layout: Layout, samples_per_shard: int, max_shard_bytes: int) -> list[ShardPlan]:
    """Cut the samples, in order, into shards of at most `samples_per_shard` samples / `max_shard_bytes`."""
    plans: list[ShardPlan] = []
    first, tokens, nbytes = 0, 0, 0
    for i, n in enumerate(lengths):
        b = layout.sample_bytes(n)
        count = i - first
        if count and (count >= samples_per_shard or nbytes + b > max_shard_bytes):
            plans.append(ShardPlan(len(plans), first, count, tokens, nbytes))
            first, tokens, nbytes = i, 0, 0
        tokens += n
        nbytes += b
    if len(lengths) > first:
        plans.append(ShardPlan(len(plans), first, len(lengths) - first, tokens, nbytes))
    return plans


def pack_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Group positions into padded batches of <= batch_tokens (longest first, so padding stays small).

    A sample longer than the budget gets a batch of its own. Depends only on `lengths`."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def encode_hidden(x: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[N, n_aux, H] float -> storage tensor (+ per-token, per-layer float32 scales for fp8)."""
    if not layout.fp8:
        return x.to(layout.torch_dtype), None
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp_min(1e-12) / FP8_MAX
    return (xf / scale.unsqueeze(-1)).to(torch.float8_e4m3fn), scale


def decode_hidden(hs: torch.Tensor, scale: torch.Tensor | None, dtype=torch.float32) -> torch.Tensor:
    if scale is None:
        return hs.to(dtype)
    return (hs.float() * scale.float().unsqueeze(-1)).to(dtype)


def content_hash(sample_digests: list[str]) -> str:
    """Over samples in order: independent of how they were sharded or how many processes wrote them."""
    return sha256_text(FORMAT + f"/{FORMAT_VERSION}\n" + "\n".join(sample_digests) + "\n")


def read_sidecar(cache_dir: Path, k: int, resume_key: str) -> dict | None:
    """The sidecar of shard k if it belongs to this run's inputs and plan and its shard file is whole."""
    p = cache_dir / sidecar_file(k)
    try:
        rec = json.loads(p.read_text(encoding="utf-8"))
        f = cache_dir / rec["shard"]["file"]
        if rec.get("resume_key") == resume_key and f.stat().st_size == rec["shard"]["bytes"]:
            return rec
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def clear_stale(cache_dir: Path, resume_key: str, num_shards: int) -> int:
    """Delete shard files/sidecars that are not reusable for `resume_key`; the index goes first, so a
    reader never sees an index whose shards are gone. Only files named like shards are touched."""
    with contextlib.suppress(FileNotFoundError):
        (cache_dir / "index.json").unlink()
    keep = {k for k in range(num_shards) if read_sidecar(cache_dir, k, resume_key) is not None}
    removed = 0
    for p in sorted(cache_dir.iterdir()) if cache_dir.is_dir() else []:
        m = _SHARD_RE.match(p.name)
        if m and (int(m.group(1)) not in keep) and p.is_file():
            p.unlink()
            removed += 1
    return removed


def build_index(cache_dir: Path, plans: list[ShardPlan], layout: Layout, inputs: dict, inputs_hash: str,
                resume_key: str, extra: dict | None = None) -> dict:
    """Assemble index.json from the sidecars of every planned shard (all must be present)."""
    shards, samples = [], []
    for plan in plans:
        rec = read_sidecar(cache_dir, plan.index, resume_key)
        if rec is None:
            raise SpecquantError(f"cache shard {shard_file(plan.index)} in {cache_dir} is missing or incomplete "
                                 "after all processes finished; re-run the cache stage to write it.")
        shards.append(rec["shard"])
        samples += [{**s, "shard": plan.index} for s in rec["samples"]]
    index = {"format": FORMAT, "format_version": FORMAT_VERSION, "inputs": inputs, "inputs_hash": inputs_hash,
             "content_hash": content_hash([s["sha256"] for s in samples]),
             "aux_layer_ids": list(layout.aux_layer_ids), "hidden_size": layout.hidden_size,
             "storage_dtype": layout.storage_dtype,
             "storage": ({"hidden_states": "float8_e4m3fn", "hidden_states_scale": "float32 [T, n_aux] = "
                          "absmax over H / 448; value = hidden_states * scale"} if layout.fp8
                         else {"hidden_states": layout.storage_dtype}),
             "num_samples": len(samples), "num_tokens": sum(s["num_tokens"] for s in samples),
             "num_shards": len(shards), "total_bytes": sum(s["bytes"] for s in shards),
             "shards": shards, "samples": samples, **(extra or {})}
    atomic_write_json(cache_dir / "index.json", index)
    return index


def finished_index(cache_dir: Path, inputs_hash: str) -> dict | None:
    """index.json if it describes a complete cache of these inputs (sizes checked, not hashes)."""
    p = cache_dir / "index.json"
    if not p.is_file():
        return None
    try:
        index = json.loads(p.read_text(encoding="utf-8"))
        if index.get("inputs_hash") != inputs_hash or index.get("format_version") != FORMAT_VERSION:
            return None
        if all((cache_dir / s["file"]).stat().st_size == s["bytes"] for s in index["shards"]):
            return check_index(cache_dir, index)  # a hand-edited index is rebuilt, not reused
    except (OSError, ValueError, KeyError, TypeError, SpecquantError):
        pass
    return None


_REBUILD = "re-run the cache stage, which rebuilds it from the shards' sidecars"


def _entries(n: int) -> str:
    return f"{n} entry" if n == 1 else f"{n} entries"


def check_index(cache_dir: str | Path, index: dict) -> dict:
    """A cheap consistency check of index.json against itself and its shard files (names and sizes, no
    hashing), so a hand-edited index or a deleted shard is one sentence before any model loads.

    Checks: the format; every shard entry is numbered in order, contiguous from sample 0, and its file
    exists with the recorded size; `num_shards`, `num_samples`, `num_tokens`, `total_bytes` and the
    content hash agree with the entries; every sample names a shard in range that holds its position,
    and each shard's token count is the sum of its samples'."""
    cache_dir = Path(cache_dir)
    where = str(cache_dir / "index.json")

    def bad(problem: str) -> SpecquantError:
        return bad_value("cache/index.json", where, problem, _REBUILD)

    if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("format_version") != FORMAT_VERSION:
        raise bad_value("cache/index.json", where, f"it is not a {FORMAT} v{FORMAT_VERSION} index",
                        "re-run the cache stage")
    try:
        shards, samples = list(index["shards"]), list(index["samples"])
        totals = {key: int(index[key]) for key in ("num_shards", "num_samples", "num_tokens", "total_bytes")}
        if totals["num_shards"] != len(shards):
            raise bad(f"num_shards is {totals['num_shards']} but `shards` has {_entries(len(shards))}")
        if totals["num_samples"] != len(samples):
            raise bad(f"num_samples is {totals['num_samples']} but `samples` has {_entries(len(samples))}")
        if not samples:
            raise bad("it lists no samples")
        first, tokens = 0, [0] * len(shards)
        for k, rec in enumerate(shards):
            if rec["file"] != shard_file(k) or int(rec["index"]) != k:
                raise bad(f"shard entry {k} names {rec['file']} (index {rec['index']}), not {shard_file(k)}")
            if int(rec["first"]) != first or int(rec["count"]) < 1:
                raise bad(f"shard {rec['file']} covers samples from {rec['first']} ({rec['count']} of them) but "
                          f"the shards before it end at sample {first}")
            first += int(rec["count"])
        if first != len(samples):
            raise bad(f"its shards hold {first} samples but `samples` has {_entries(len(samples))}")
        for i, s in enumerate(samples):
            k = s["shard"]
            if not isinstance(k, int) or not 0 <= k < len(shards):
                raise bad(f"sample {i} ({s.get('id')}) names shard {k!r} but the shards are numbered 0 to {len(shards) - 1}")
            if not int(shards[k]["first"]) <= i < int(shards[k]["first"]) + int(shards[k]["count"]):
                raise bad(f"sample {i} ({s.get('id')}) names shard {k}, which does not hold sample {i}")
            n = s["num_tokens"]
            if not isinstance(n, int) or n < 1:
                raise bad(f"sample {i} ({s.get('id')}) has num_tokens {n!r}")
            tokens[k] += n
        for k, rec in enumerate(shards):
            if int(rec["num_tokens"]) != tokens[k]:
                raise bad(f"shard {rec['file']} records {rec['num_tokens']} tokens but its samples add up to {tokens[k]}")
        if totals["num_tokens"] != sum(tokens):
            raise bad(f"num_tokens is {totals['num_tokens']} but its samples add up to {sum(tokens)}")
        if totals["total_bytes"] != sum(int(rec["bytes"]) for rec in shards):
            raise bad(f"total_bytes is {totals['total_bytes']} but its shards add up to "
                      f"{sum(int(rec['bytes']) for rec in shards)}")
        if "content_hash" in index and index["content_hash"] != content_hash([str(s["sha256"]) for s in samples]):
            raise bad("its content_hash does not match its samples' digests")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise bad(f"an entry is missing or malformed ({type(exc).__name__}: {exc})") from None
    for rec in shards:
        path = cache_dir / rec["file"]
        if not path.is_file():
            raise bad_value("cache/index.json", where, f"it lists {rec['file']}, which is missing from {cache_dir}",
                            "re-run the cache stage, which rewrites the missing shard")
        size = path.stat().st_size
        if size != int(rec["bytes"]):
            raise bad_value("cache/index.json", where, f"it records {rec['bytes']} bytes for {rec['file']} but the "
                            f"file holds {size} (truncated or replaced)", "re-run the cache stage, which rewrites it")
    return index


def read_index(cache_dir: str | Path) -> dict:
    """`<cache_dir>/index.json`, refused unless it is a specquant-cache index of this format version and
    agrees with itself and its shard files (`check_index`); the one reader of the index."""
    cache_dir = Path(cache_dir)
    return check_index(cache_dir, read_json(cache_dir / "index.json", f"{cache_dir.name}/index.json"))


class CacheReader:
    """Read a finished cache. Shard hashes are verified lazily: the first access to a shard hashes
    the whole file and compares it with index.json (`verify="open"` checks every shard up front,
    `verify=False` skips the check). Hidden states come back as `dtype` (float32 by default)."""

    def __init__(self, cache_dir: str | Path, verify: str | bool = "lazy", dtype: torch.dtype = torch.float32):
        self.dir = Path(cache_dir)
        self.index = read_index(self.dir)
        self.dtype, self._verify = dtype, verify
        self._verified: set[int] = set()
        self._first = [s["first"] for s in self.index["shards"]]
        self._open: tuple[int, Any] | None = None
        if verify == "open":
            self.verify()

    def __len__(self) -> int:
        return int(self.index["num_samples"])

    @property
    def aux_layer_ids(self) -> list[int]:
        return list(self.index["aux_layer_ids"])

    def verify_shard(self, k: int) -> None:
        rec = self.index["shards"][k]
        path = self.dir / rec["file"]
        if not path.is_file():
            raise SpecquantError(f"cache shard {rec['file']} is missing from {self.dir}; re-run the cache stage.")
        actual = sha256_file(path)
        if actual != rec["sha256"]:
            raise SpecquantError(f"cache shard {rec['file']} in {self.dir} does not match its sha256 in index.json "
                                 f"(recorded {rec['sha256'][:12]}..., found {actual[:12]}...), so it is corrupt "
                                 "or was changed; delete it and re-run the cache stage.")
        self._verified.add(k)

    def verify(self) -> None:
        for k in range(len(self.index["shards"])):
            self.verify_shard(k)

    def _shard(self, k: int):
        from safetensors import safe_open

        if self._open is None or self._open[0] != k:
            if self._verify and k not in self._verified:
                self.verify_shard(k)
            self._open = (k, safe_open(str(self.dir / self.index["shards"][k]["file"]), framework="pt"))
        return self._open[1]

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        s = self.index["samples"][i]
        f = self._shard(s["shard"])
        scale = f.get_tensor(f"s{i}.hidden_states_scale") if self.index["storage_dtype"] == "fp8" else None
        return {"id": s["id"], "input_ids": f.get_tensor(f"s{i}.input_ids").long(),
                "loss_mask": f.get_tensor(f"s{i}.loss_mask").long(),
                "hidden_states": decode_hidden(f.get_tensor(f"s{i}.hidden_states"), scale, self.dtype)}

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]


__all__ = ["CacheReader", "check_index", "Layout", "ShardPlan", "plan_shards", "pack_batches", "encode_hidden",
           "decode_hidden", "content_hash", "build_index", "read_index", "clear_stale", "read_sidecar", "finished_index",
           "check_storage_dtype", "FORMAT", "FORMAT_VERSION", "STORAGE_DTYPES", "shard_file"]

