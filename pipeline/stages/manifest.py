"""Manifest stage: `calibration_manifest.json`, `quant_run_manifest.json` and `provenance/` for a run.

Reads only files: the stage records (`stages/*.json`), data/, cache/index.json, the checkpoints
under drafter/ and target/, checks/ and eval/. A stage that has not run leaves its section null and
its name in `not_run`. Timing is isolated in each manifest's `timing` section and in the
attestation's `runDetails.metadata`, so same config + seed gives byte-identical manifests otherwise.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from pipeline.artifacts import check_report, eval_results, manifests
from pipeline.artifacts import samples as samples_file
from pipeline.artifacts.cache import read_index
from pipeline.artifacts.rundir import RunDir
from pipeline.artifacts.stage_record import StageRecord
from pipeline.core.errors import bad_value
from pipeline.core.io import atomic_write_json, atomic_write_text, dumps_json, sha256_bytes, sha256_file
from pipeline.core.secrets import scrub, scrub_obj
from pipeline.models.checkpoint_info import CheckpointInfo
from pipeline.provenance import record as prov
from pipeline.serving import command, report
from pipeline.stages import ORDER

OWN_OUTPUTS = (manifests.CALIBRATION, manifests.QUANT_RUN, "provenance/")


def _local(path: str | None) -> Path | None:
    if not path:
        return None
    for p in (Path(path), prov.REPO_ROOT / path):
        if p.exists():
            return p
    return None


class Inputs:
    """Hashes each input checkpoint / file once and remembers it for the manifests and the attestation."""

    def __init__(self):
        self.refs: dict[tuple, dict] = {}

    def checkpoint(self, spec: dict | None) -> dict | None:
        if not spec or not spec.get("path"):
            return None
        key = (spec["path"], spec.get("revision"))
        if key not in self.refs:
            self.refs[key] = self._checkpoint(spec["path"], spec.get("revision"))
        return self.refs[key]

    @staticmethod
    def _checkpoint(path: str, revision: str | None) -> dict:
        """Weight + config files (`pipeline.core.loading.checkpoint_hashes`) of a local directory, or of a Hub
        repo already in the local cache; otherwise the repo id + revision is the reference."""
        from pipeline.core.loading import checkpoint_hashes

        local = _local(path)
        if local is not None and local.is_dir():
            return {"local_path": path, "repo_id": None, "revision": None, "files": checkpoint_hashes(local)}
        return {"local_path": None, "repo_id": path, "revision": revision, "files": checkpoint_hashes(path, revision)}

    def dependencies(self, sources: list[dict]) -> list[dict]:
        deps = []
        for ref in self.refs.values():
            base = ref["local_path"] or ref["repo_id"]
            for rel, e in sorted((ref["files"] or {}).items()):
                uri = (f"file:{ref['local_path']}/{rel}" if ref["local_path"] else
                       f"https://huggingface.co/{ref['repo_id']}/resolve/{ref['revision'] or 'main'}/{rel}")
                deps.append({"name": f"{base}/{rel}", "uri": uri, "digest": {"sha256": e["sha256"]}})
            if ref["files"] is None:
                deps.append({"name": base, "uri": f"https://huggingface.co/{ref['repo_id']}",
                             **({"annotations": {"revision": ref["revision"]}} if ref["revision"] else {})})
        for s in sources:
            d = {"name": f"data:{s.get('name')}", "uri": f"file:{s['path']}" if s.get("path") else
                 f"https://huggingface.co/datasets/{s.get('hub_id')}"}
            if s.get("sha256"):
                d["digest"] = {"sha256": s["sha256"]}
            notes = {k: s.get(k) for k in ("revision", "split") if s.get(k) is not None}
            if notes:
                d["annotations"] = notes
            deps.append(d)
        return deps


def _stage_summary(name: str, rec: StageRecord) -> dict:
    return {"record": f"stages/{name}.json", "stage": rec.stage, "command": rec.command,
            "overrides": rec.overrides, "seed": rec.seed, "versions": rec.versions,
            "git": rec.git, "device": rec.device, "source_sha256": rec.source_sha256}


def _source_section(source: dict, records: dict[str, StageRecord]) -> dict:
    """Which code produced the outputs: the snapshot in provenance/source/ and whether each stage ran it."""
    match = {n: (r.source_sha256 == source["tree_sha256"]) if r.source_sha256 else None
             for n, r in records.items()}
    return {"snapshot": "provenance/source/SOURCE.json", "tree_sha256": source["tree_sha256"],
            "git": {k: source["git"][k] for k in ("commit", "dirty")}, "stages_ran_this_source": match}


TIMING_KEYS = ("timings", "seconds", "tokens_per_s")


def _is_timing(key: str) -> bool:
    """Wall-clock values a stage reports in its result (they differ run to run, so they live in `timing`)."""
    return key in TIMING_KEYS or key.endswith(("_s", "_seconds", "_per_s"))


def _untimed(result: Any) -> Any:
    return {k: v for k, v in result.items() if not _is_timing(k)} if isinstance(result, dict) else result


def _timing(records: dict[str, StageRecord]) -> dict:
    out = {}
    for n, r in records.items():
        out[n] = {"started_utc": r.started_utc, "wall_time_s": r.wall_time_s}
        res = r.result
        if any(_is_timing(k) for k in res):
            out[n]["result"] = {k: v for k, v in res.items() if _is_timing(k)}
    return out


# ---------------------------------------------------------------- calibration manifest
def _counts(counts: dict[str, samples_file.SourceCounts]) -> dict:
    """counts.json per source (`pipeline.artifacts.samples.SourceCounts`) with the drops' total."""
    return {src: {**dataclasses.asdict(c), "dropped_total": sum(c.dropped.values())} for src, c in sorted(counts.items())}


def _tokenizer(meta: samples_file.DataMeta) -> dict:
    """The tokenizer the data stage used and its file hashes, as data/meta.json records them
    (`pipeline.stages.data.tokenizer_hashes`)."""
    tok = meta.tokenizer
    return {"path": tok.name_or_path, "revision": tok.revision, "sha256": tok.sha256, "files": tok.files}


def _sources(meta: samples_file.DataMeta) -> list[dict]:
    """The blend's sources as data/meta.json names them, each local file's sha256 added."""
    out = []
    for src in meta.sources:
        s = dataclasses.asdict(src)
        local = _local(s["path"])
        if local is not None and local.is_file():
            s["sha256"] = sha256_file(local)
        out.append(s)
    return out


def calibration_manifest(rd: RunDir, records: dict, tree: dict, run_name: str) -> dict:
    data = None
    if (rd.data / samples_file.META).is_file():  # the data stage's files, through its reader (pipeline/artifacts/samples.py)
        meta, counts = samples_file.load_meta(rd.data), samples_file.load_counts(rd.data)
        data = {"sources": _sources(meta), "counts": _counts(counts), "seed": meta.seed,
                "max_seq_len": meta.max_seq_len, "num_samples": meta.num_samples, "num_tokens": meta.num_tokens,
                "samples_sha256": meta.samples_sha256, "tokenizer": _tokenizer(meta),
                "files": {r: e for r, e in tree.items() if r.startswith("data/")}, "meta": dataclasses.asdict(meta)}
    # the bf16 target's cache and the quantized targets' (cache cache.target=<variant>), by target variant
    caches = {t: _cache_section(p, tree) for t, p in rd.caches().items()}
    cache = caches.pop("bf16", None)
    stages = {n: _stage_summary(n, r) for n, r in records.items() if r.stage in ("data", "cache")}
    return {"schema": "specquant.calibration_manifest/v1", "run_name": run_name, "data": data, "cache": cache,
            "target_caches": caches,
            "stages": stages, "timing": _timing({n: records[n] for n in stages}),
            "not_run": [s for s, sec in (("data", data), ("cache", cache)) if sec is None]}


def _cache_section(cache_dir: Path, tree: dict) -> dict:
    """A cache folder as its index.json (read and checked by `pipeline.artifacts.cache.read_index`) and the
    run's file hashes describe it; a shard whose bytes differ from the index is refused."""
    folder = cache_dir.name
    index = read_index(cache_dir)
    claims = {s["file"]: s["sha256"] for s in index["shards"]}
    on_disk = {Path(r).name for r in tree if r.startswith(f"{folder}/") and r.endswith(".safetensors")}
    shards = []
    for name in sorted(set(claims) | on_disk):
        rel = f"{folder}/{name}"
        if rel not in tree:
            raise bad_value("cache", rel, f"{folder}/index.json lists this shard but the file is missing",
                            "re-run `make cache` to rebuild the cache")
        if name in claims and claims[name] != tree[rel]["sha256"]:
            raise bad_value("cache", rel, f"its sha256 {tree[rel]['sha256'][:12]}... differs from the "
                            f"{claims[name][:12]}... recorded in {folder}/index.json (the shard is corrupt)",
                            "re-run `make cache` to rebuild it")
        shards.append({"file": rel, **tree[rel], "in_index": name in claims})
    return {"folder": folder,
            # written by the cache stage; an imported cache (pipeline/artifacts/cache_import.py) is of the bf16 target
            "target_variant": index.get("target_variant", "bf16"),
            "index_sha256": tree[f"{folder}/index.json"]["sha256"],
            "content_sha256": index["content_hash"], "content_sha256_from": "cache/index.json",
            "aux_layer_ids": index["aux_layer_ids"], "dtype": index["storage_dtype"],
            "num_samples": index["num_samples"], "shards": shards,
            "index_fields": {k: v for k, v in index.items() if k not in ("shards", "samples")}}


# ---------------------------------------------------------------- quant run manifest
def _checkpoint_entry(rd: RunDir, kind: str, variant: str, records: dict, tree: dict, inputs: Inputs,
                      calib: dict) -> dict:
    name = f"quantize-{kind}-{variant}"
    rec = records.get(name)
    qcfg = rec.resolved_config.get("quant" if kind == "drafter" else "target_quant") if rec else None
    if rec is None:  # a by-product (e.g. drafter/bf16, the reference a quantize stage writes): credit that stage
        name, rec = next(((n, r) for n, r in records.items() if str(r.result.get("reference", ""))
                          .rstrip("/").endswith(f"{kind}/{variant}")), (name, None))
    cfg = rec.resolved_config if rec else {}
    rel = f"{kind}/{variant}"
    # the quantization_config the checkpoint is served with, read as every stage reads a checkpoint's facts
    qconf = CheckpointInfo.read(rd.root / rel, rel).quantization_config
    recipe = None
    if (rd.root / rel / "recipe.yaml").is_file():
        import yaml

        text = (rd.root / rel / "recipe.yaml").read_text(encoding="utf-8")
        recipe = {"file": f"{rel}/recipe.yaml", "sha256": tree[f"{rel}/recipe.yaml"]["sha256"], "text": text,
                  "parsed": yaml.safe_load(text)}
    res = rec.result if rec is not None and qcfg is not None else {}
    q = qcfg or {}
    # the stage's result holds the effective values (e.g. q/k/v added to ignore); the config is the fallback
    scheme = res.get("scheme") or q.get("scheme") or (f"compressed-tensors:{qconf.get('format')}" if qconf
                                                       else "unquantized")
    seeds = {"seed": rec.seed if rec else None, **{k: v for k, v in res.items() if "seed" in k and isinstance(v, int)},
             **(res.get("seeds") if isinstance(res.get("seeds"), dict) else {})}
    check_rel = f"{check_report.FOLDER}/{check_report.name(kind, variant)}"
    cal_target = res.get("calibration_target") if kind == "drafter" else None
    cal_variant = (cal_target or {}).get("variant") or "bf16"
    cache = (calib.get("cache") if cal_variant == "bf16" else (calib.get("target_caches") or {}).get(cal_variant)) or {}
    return {
        "kind": kind, "variant": variant, "path": rel, "scheme": scheme, "quant_config": qcfg,
        "observer": res.get("observer", q.get("observer")),
        "observer_kwargs": res.get("observer_kwargs", q.get("observer_kwargs")),
        "group_size": res.get("group_size", q.get("group_size")), "ignore": res.get("ignore", q.get("ignore")),
        "recipe": recipe, "quantization_config": qconf, "seeds": seeds,
        "inputs": {"drafter": inputs.checkpoint(cfg.get("drafter")) if kind == "drafter" else None,
                   "target": inputs.checkpoint(cfg.get("target")),
                   "calibration_cache": ({"content_sha256": cache.get("content_sha256"),
                                          "index_sha256": cache.get("index_sha256")}
                                         if kind == "drafter" and cache and qcfg and qcfg.get("calibration") != "none"
                                         else None)},
        # the target whose cached hidden states calibrated this drafter (pipeline.quant.pairing)
        "calibration_target": cal_target,
        "files": {r[len(rel) + 1:]: e for r, e in tree.items() if r.startswith(rel + "/")},
        "checks": ({"file": check_rel, "sha256": tree[check_rel]["sha256"],
                    "report": check_report.read_report(rd.root / check_rel).to_json()} if check_rel in tree else None),
        "stage": ({**_stage_summary(name, rec), "result": _untimed(rec.result)} if rec else None),
        "serving": report.status_for(rd.root, variant) if kind == "drafter" else None,
        # drafters: the vLLM range the checkpoint is written and checked for (quantize-drafter's record,
        # pipeline.serving.contract.Profile.record); null for targets and a drafter no quantize-drafter wrote
        "vllm": res.get("vllm") if kind == "drafter" else None,
    }


def quant_run_manifest(rd: RunDir, records: dict, tree: dict, inputs: Inputs, calib: dict, cfg,
                       source: dict) -> dict:
    from pipeline.provenance.environment import device_info, git_state, package_versions

    ckpts = [_checkpoint_entry(rd, k, v, records, tree, inputs, calib)
             for k, variants in (("drafter", rd.drafter_variants()), ("target", rd.target_variants()))
             for v in variants]
    ran = {r.stage for r in records.values()}
    return {"schema": "specquant.quant_run_manifest/v1", "run_name": str(cfg.run_name), "seed": int(cfg.seed),
            "checkpoints": ckpts,
            "environment": {"versions": package_versions(), "git": git_state(), "device": device_info()},
            "source": _source_section(source, records),
            "stages": {n: _stage_summary(n, r) for n, r in records.items()},
            "timing": _timing(records),
            "not_run": [s for s in ORDER[:ORDER.index("manifest")] if s not in ran]}


# ---------------------------------------------------------------- the stage
def run(cfg) -> dict:
    rd = RunDir.from_cfg(cfg)
    if not rd.root.is_dir():
        raise bad_value("run_dir", str(rd.root), "the run directory does not exist",
                        "run the earlier stages first (`make data cache quantize-drafter`) or fix run_name/runs_root")
    records = prov.load_records(rd.root, ORDER)
    if not records:
        raise bad_value("run_dir", str(rd.root), "it has no stage records under stages/",
                        "run at least one stage (`make data`) before `make manifest`")
    def skip(rel):
        return (prov.is_late(rel) or any(rel == o or rel.startswith(o) for o in OWN_OUTPUTS))
    tree = prov.hash_files(rd.root, prov.list_files(rd.root, skip), desc="hashing run outputs")
    inputs, source = Inputs(), prov.source_info()
    calib = scrub_obj(calibration_manifest(rd, records, tree, str(cfg.run_name)))
    quant = scrub_obj(quant_run_manifest(rd, records, tree, inputs, calib, cfg, source))
    # both validated against manifests/*.schema.json before either is written (pipeline/artifacts/manifests.py)
    texts = manifests.write(rd.root, calib, quant, scrub)

    commands = scrub_obj(prov.commands_doc(records))
    p = "provenance/"
    written: dict[str, str] = {p + "commands.json": dumps_json(commands)}
    written[p + "commands.sh"] = prov.commands_sh(commands)
    for name, rec in records.items():
        written[f"{p}resolved_config/{name}.yaml"] = prov.resolved_config_yaml(rec)
    eval_rec = records.get("evaluate")
    last_cfg = list(records.values())[-1].resolved_config
    written[p + "vllm_serve.sh"] = prov.vllm_serve_sh(
        last_cfg.get("target") or {}, {v: command.drafter_settings(rd.drafter(v)) for v in rd.drafter_variants()})
    written[p + "eval_commands.sh"] = prov.eval_commands_sh(
        eval_rec, (eval_rec.config("eval") if eval_rec else None) or last_cfg.get("eval") or {},
        eval_results.read_vllm_commands(rd.eval))
    written = {rel: scrub(text) for rel, text in written.items()}
    for rel, text in written.items():
        atomic_write_text(rd.root / rel, text)
    source = prov.write_source_snapshot(rd.provenance / "source", source)
    keep = set(texts) | set(written) | {f"{p}source/{r}" for r in source["files"]} | {f"{p}source/SOURCE.json"}
    if source["git"]["diff"]:
        keep.add(f"{p}source/git.diff")
    _remove_stale(rd.root, keep)

    subjects = {**tree, **prov.hash_files(rd.root, sorted(keep))}
    sources = (calib.get("data") or {}).get("sources") or []
    statement = prov.attestation(subjects, records, inputs.dependencies(sources)
                                 + [{"name": "specquant source", "digest": _source_digest(source)}],
                                 source, str(cfg.run_name))
    atomic_write_json(rd.root / prov.ATTESTATION, statement)
    att = rd.root / prov.ATTESTATION
    listed = prov.write_file_list(rd.root, kind="run", files={
        **subjects, prov.ATTESTATION: {"sha256": sha256_file(att), "bytes": att.stat().st_size}})
    return {"output": str(rd.root), "files_listed": len(listed.files), "checkpoints": len(quant["checkpoints"]),
            "not_run": sorted(set(calib["not_run"]) | set(quant["not_run"])),
            "calibration_manifest_sha256": sha256_bytes(texts[manifests.CALIBRATION].encode()),
            "quant_run_manifest_sha256": sha256_bytes(texts[manifests.QUANT_RUN].encode()),
            "files_sha256": listed.files_sha256}


def _source_digest(source: dict) -> dict:
    d = {"sha256": source["tree_sha256"]}
    if source["git"]["commit"]:
        d["gitCommit"] = source["git"]["commit"]
    return d


def _remove_stale(root: Path, keep: set[str]) -> None:
    """Drop provenance files of an earlier manifest run that this run did not write (e.g. a removed variant)."""
    for rel in prov.list_files(root / "provenance"):
        full = f"provenance/{rel}"
        if full not in keep and full not in (prov.ATTESTATION, prov.FILE_LIST):
            (root / full).unlink()
