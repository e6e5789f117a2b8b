"""Manifest stage: `calibration_manifest.json`, `quant_run_manifest.json` and `provenance/` for a run.

Reads only files: the stage records (`stages/*.json`), data/, cache/index.json, the checkpoints
under drafter/ and target/, checks/ and eval/. A stage that has not run leaves its section null and
its name in `not_run`. Timing is isolated in each manifest's `timing` section and in the
attestation's `runDetails.metadata`, so same config + seed gives byte-identical manifests otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.artifacts.rundir import RunDir
from pipeline.core.errors import SpecquantError, bad_value
from pipeline.core.io import atomic_write_json, atomic_write_text, dumps_json, sha256_bytes, sha256_file
from pipeline.core.secrets import scrub, scrub_obj
from pipeline.provenance import record as prov
from pipeline.stages import serve_check

SCHEMA_DIR = Path(__file__).resolve().parents[2] / "manifests"
OWN_OUTPUTS = ("calibration_manifest.json", "quant_run_manifest.json", "provenance/")


def validate(doc: dict, schema_name: str) -> None:
    """Raise SpecquantError naming the first schema violation (a manifest must never be written invalid)."""
    import jsonschema

    schema = json.loads((SCHEMA_DIR / f"{schema_name}.schema.json").read_text(encoding="utf-8"))
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(doc), key=lambda e: list(e.path))
    if errors:
        e = errors[0]
        where = "/".join(str(p) for p in e.path) or "(top level)"
        raise SpecquantError(f"{schema_name}.json does not match manifests/{schema_name}.schema.json at {where}: "
                             f"{e.message}; this is a bug in pipeline/stages/manifest.py, please report it.")


def _read(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


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


def _stage_summary(name: str, rec: dict) -> dict:
    return {"record": f"stages/{name}.json", "stage": rec.get("stage", name), "command": rec.get("command"),
            "overrides": rec.get("overrides", []), "seed": rec.get("seed"), "versions": rec.get("versions"),
            "git": rec.get("git"), "device": rec.get("device"), "source_sha256": rec.get("source_sha256")}


def _source_section(source: dict, records: dict) -> dict:
    """Which code produced the outputs: the snapshot in provenance/source/ and whether each stage ran it."""
    match = {n: (r["source_sha256"] == source["tree_sha256"]) if r.get("source_sha256") else None
             for n, r in records.items()}
    return {"snapshot": "provenance/source/SOURCE.json", "tree_sha256": source["tree_sha256"],
            "git": {k: source["git"][k] for k in ("commit", "dirty")}, "stages_ran_this_source": match}


TIMING_KEYS = ("timings", "seconds", "tokens_per_s")


def _is_timing(key: str) -> bool:
    """Wall-clock values a stage reports in its result (they differ run to run, so they live in `timing`)."""
    return key in TIMING_KEYS or key.endswith(("_s", "_seconds", "_per_s"))


def _untimed(result: Any) -> Any:
    return {k: v for k, v in result.items() if not _is_timing(k)} if isinstance(result, dict) else result


def _timing(records: dict[str, dict]) -> dict:
    out = {}
    for n, r in records.items():
        out[n] = {"started_utc": r.get("started_utc"), "wall_time_s": r.get("wall_time_s")}
        res = r.get("result") if isinstance(r.get("result"), dict) else {}
        if any(_is_timing(k) for k in res):
            out[n]["result"] = {k: v for k, v in res.items() if _is_timing(k)}
    return out


# ---------------------------------------------------------------- calibration manifest
def _counts(counts: Any) -> dict | None:
    if not isinstance(counts, dict):
        return None
    per = counts.get("sources", counts) if isinstance(counts.get("sources"), dict) else counts
    out = {}
    for src, c in sorted(per.items()):
        if not isinstance(c, dict):
            continue
        dropped = c.get("dropped", {})
        total = sum(dropped.values()) if isinstance(dropped, dict) else dropped
        out[src] = {**c, "kept": c.get("kept"), "dropped": dropped if isinstance(dropped, dict) else {"unspecified": dropped},
                    "dropped_total": total}
    return out


def _tokenizer(meta: dict, data_cfg: dict) -> dict:
    """The tokenizer the data stage used: its file hashes as data/meta.json records them
    (`pipeline.stages.data.tokenizer_hashes`), else hashed now from the configured path."""
    from pipeline.stages.data import tokenizer_hashes

    tok = meta.get("tokenizer")
    if isinstance(tok, dict) and (tok.get("sha256") or tok.get("files")):
        files = tok.get("files")
        digest = tok.get("sha256") or sha256_bytes(dumps_json(files).encode())
        return {"path": tok.get("path") or tok.get("name_or_path"), "revision": tok.get("revision"),
                "sha256": digest, "files": files}
    target = data_cfg.get("target") or {}
    path = (tok if isinstance(tok, str) else None) or target.get("tokenizer") or target.get("path")
    local = _local(path)
    hashes = tokenizer_hashes(local) if local and local.is_dir() else {"files": None, "sha256": None}
    return {"path": path, **hashes}


def _sources(meta: dict, data_cfg: dict) -> list[dict]:
    sources = meta.get("sources") or (data_cfg.get("data") or {}).get("sources") or []
    out = []
    for s in sources:
        s = dict(s)
        s.setdefault("revision", None)
        local = _local(s.get("path"))
        if local is not None and local.is_file() and "sha256" not in s:
            s["sha256"] = sha256_file(local)
        out.append(s)
    return out


def calibration_manifest(rd: RunDir, records: dict, tree: dict, run_name: str) -> dict:
    data_rec, cache_rec = records.get("data"), records.get("cache")
    meta, counts, index = _read(rd.data / "meta.json"), _read(rd.data / "counts.json"), _read(rd.cache / "index.json")
    data = None
    if meta is not None or counts is not None:
        meta = meta or {}
        cfg = (data_rec or {}).get("resolved_config") or {}
        data = {"sources": _sources(meta, cfg), "counts": _counts(counts),
                "seed": meta.get("seed", (data_rec or {}).get("seed")),
                "max_seq_len": meta.get("max_seq_len", (cfg.get("data") or {}).get("max_seq_len")),
                "num_samples": meta.get("num_samples"), "num_tokens": meta.get("num_tokens"),
                "samples_sha256": meta.get("samples_sha256"), "tokenizer": _tokenizer(meta, cfg),
                "files": {r: e for r, e in tree.items() if r.startswith("data/")}, "meta": meta}
    cache = _cache_section(rd, index, tree, cache_rec) if index is not None else None
    # caches of the quantized targets' hidden states (cache cache.target=<variant>), by target variant
    pair_caches = {t: _cache_section(rd, _read(p / "index.json"), tree, records.get(f"cache-{t}"), p.name)
                   for t, p in rd.caches().items() if t != "bf16"}
    stages = {n: _stage_summary(n, r) for n, r in records.items() if r.get("stage") in ("data", "cache")}
    return {"schema": "specquant.calibration_manifest/v1", "run_name": run_name, "data": data, "cache": cache,
            "target_caches": pair_caches,
            "stages": stages, "timing": _timing({n: records[n] for n in stages}),
            "not_run": [s for s, sec in (("data", data), ("cache", cache)) if sec is None]}


def _shard_claims(index: dict) -> dict[str, str | None]:
    shards = index.get("shards") or []
    claims = {}
    items = shards.items() if isinstance(shards, dict) else enumerate(shards)
    for key, s in items:
        if isinstance(s, str):
            claims[s] = None
        elif isinstance(s, dict):
            name = s.get("file") or s.get("name") or s.get("path") or (key if isinstance(key, str) else None)
            if name:
                claims[Path(name).name] = s.get("sha256")
    return claims


def _cache_section(rd: RunDir, index: dict, tree: dict, rec: dict | None, folder: str = "cache") -> dict:
    claims = _shard_claims(index)
    on_disk = {Path(r).name for r in tree if r.startswith(f"{folder}/") and r.endswith(".safetensors")}
    shards = []
    for name in sorted(set(claims) | on_disk):
        rel = f"{folder}/{name}"
        if rel not in tree:
            raise bad_value("cache", rel, "cache/index.json lists this shard but the file is missing",
                            "re-run `make cache` to rebuild the cache")
        if claims.get(name) and claims[name] != tree[rel]["sha256"]:
            raise bad_value("cache", rel, f"its sha256 {tree[rel]['sha256'][:12]}... differs from the "
                            f"{claims[name][:12]}... recorded in cache/index.json (the shard is corrupt)",
                            "re-run `make cache` to rebuild it")
        shards.append({"file": rel, **tree[rel], "in_index": name in claims})
    cfg = (rec or {}).get("resolved_config") or {}
    content = index.get("content_sha256") or index.get("content_hash")
    return {"folder": folder, "target_variant": index.get("target_variant", "bf16"),
            "index_sha256": tree[f"{folder}/index.json"]["sha256"],
            "content_sha256": content or sha256_bytes(dumps_json([s["sha256"] for s in shards]).encode()),
            "content_sha256_from": "cache/index.json" if content else "shard sha256 list (index has none)",
            "aux_layer_ids": index.get("aux_layer_ids", index.get("aux_hidden_state_layer_ids")),
            "dtype": index.get("storage_dtype", index.get("dtype", (cfg.get("cache") or {}).get("storage_dtype"))),
            "num_samples": index.get("num_samples"), "shards": shards,
            "index_fields": {k: v for k, v in index.items() if k not in ("shards", "samples")}}


# ---------------------------------------------------------------- quant run manifest
def _checkpoint_entry(rd: RunDir, kind: str, variant: str, records: dict, tree: dict, inputs: Inputs,
                      calib: dict) -> dict:
    name = f"quantize-{kind}-{variant}"
    rec = records.get(name)
    qcfg = (((rec or {}).get("resolved_config") or {}).get("quant" if kind == "drafter" else "target_quant"))
    if rec is None:  # a by-product (e.g. drafter/bf16, the reference a quantize stage writes): credit that stage
        name, rec = next(((n, r) for n, r in records.items() if str((r.get("result") or {}).get("reference", ""))
                          .rstrip("/").endswith(f"{kind}/{variant}")), (name, None))
    cfg = (rec or {}).get("resolved_config") or {}
    rel = f"{kind}/{variant}"
    conf = _read(rd.root / rel / "config.json") or {}
    qconf = conf.get("quantization_config")
    recipe = None
    if (rd.root / rel / "recipe.yaml").is_file():
        import yaml

        text = (rd.root / rel / "recipe.yaml").read_text(encoding="utf-8")
        recipe = {"file": f"{rel}/recipe.yaml", "sha256": tree[f"{rel}/recipe.yaml"]["sha256"], "text": text,
                  "parsed": yaml.safe_load(text)}
    res = ((rec or {}).get("result") or {}) if qcfg is not None else {}
    q = qcfg or {}
    # the stage's result holds the effective values (e.g. q/k/v added to ignore); the config is the fallback
    scheme = res.get("scheme") or q.get("scheme") or (f"compressed-tensors:{qconf.get('format')}" if qconf
                                                       else "unquantized")
    seeds = {"seed": (rec or {}).get("seed"), **{k: v for k, v in res.items() if "seed" in k and isinstance(v, int)},
             **(res.get("seeds") if isinstance(res.get("seeds"), dict) else {})}
    check_rel = f"checks/{kind}-{variant}.json"
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
        "checks": ({"file": check_rel, "sha256": tree[check_rel]["sha256"], "report": _read(rd.root / check_rel)}
                   if check_rel in tree else None),
        "stage": ({**_stage_summary(name, rec), "result": _untimed(rec.get("result"))} if rec else None),
        "serving": serve_check.status_for(rd, variant) if kind == "drafter" else None,
    }


def quant_run_manifest(rd: RunDir, records: dict, tree: dict, inputs: Inputs, calib: dict, cfg,
                       source: dict) -> dict:
    from pipeline.stages.runner import device_info, git_state, package_versions

    ckpts = [_checkpoint_entry(rd, k, v, records, tree, inputs, calib)
             for k, variants in (("drafter", rd.drafter_variants()), ("target", rd.target_variants()))
             for v in variants]
    ran = {r.get("stage", n) for n, r in records.items()}
    return {"schema": "specquant.quant_run_manifest/v1", "run_name": str(cfg.run_name), "seed": int(cfg.seed),
            "checkpoints": ckpts,
            "environment": {"versions": package_versions(), "git": git_state(), "device": device_info()},
            "source": _source_section(source, records),
            "stages": {n: _stage_summary(n, r) for n, r in records.items()},
            "timing": _timing(records),
            "not_run": [s for s in prov.STAGE_ORDER[:prov.STAGE_ORDER.index("manifest")] if s not in ran]}


# ---------------------------------------------------------------- the stage
def run(cfg) -> dict:
    rd = RunDir.from_cfg(cfg)
    if not rd.root.is_dir():
        raise bad_value("run_dir", str(rd.root), "the run directory does not exist",
                        "run the earlier stages first (`make data cache quantize-drafter`) or fix run_name/runs_root")
    records = prov.load_records(rd.root)
    if not records:
        raise bad_value("run_dir", str(rd.root), "it has no stage records under stages/",
                        "run at least one stage (`make data`) before `make manifest`")
    def skip(rel):
        return (prov.is_late(rel) or any(rel == o or rel.startswith(o) for o in OWN_OUTPUTS))
    tree = prov.hash_files(rd.root, prov.list_files(rd.root, skip), desc="hashing run outputs")
    inputs, source = Inputs(), prov.source_info()
    calib = scrub_obj(calibration_manifest(rd, records, tree, str(cfg.run_name)))
    quant = scrub_obj(quant_run_manifest(rd, records, tree, inputs, calib, cfg, source))
    validate(calib, "calibration_manifest")
    validate(quant, "quant_run_manifest")

    written: dict[str, str] = {"calibration_manifest.json": dumps_json(calib), "quant_run_manifest.json": dumps_json(quant)}
    commands = scrub_obj(prov.commands_doc(records))
    p = "provenance/"
    written[p + "commands.json"] = dumps_json(commands)
    written[p + "commands.sh"] = prov.commands_sh(commands)
    for name, rec in records.items():
        written[f"{p}resolved_config/{name}.yaml"] = prov.resolved_config_yaml(rec)
    eval_rec = records.get("evaluate")
    last_cfg = (list(records.values())[-1].get("resolved_config") or {})
    written[p + "vllm_serve.sh"] = prov.vllm_serve_sh(
        last_cfg.get("target") or {}, {v: prov.drafter_block_size(rd.drafter(v)) for v in rd.drafter_variants()})
    vllm_cmds = rd.eval / "vllm_commands.sh"
    written[p + "eval_commands.sh"] = prov.eval_commands_sh(
        eval_rec, ((eval_rec or {}).get("resolved_config") or {}).get("eval") or last_cfg.get("eval") or {},
        vllm_cmds.read_text(encoding="utf-8") if vllm_cmds.is_file() else None)
    written = {rel: scrub(text) for rel, text in written.items()}
    for rel, text in written.items():
        atomic_write_text(rd.root / rel, text)
    source = prov.write_source_snapshot(rd.provenance / "source", source)
    keep = set(written) | {f"{p}source/{r}" for r in source["files"]} | {f"{p}source/SOURCE.json"}
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
    return {"output": str(rd.root), "files_listed": len(listed["files"]), "checkpoints": len(quant["checkpoints"]),
            "not_run": sorted(set(calib["not_run"]) | set(quant["not_run"])),
            "calibration_manifest_sha256": sha256_bytes(written["calibration_manifest.json"].encode()),
            "quant_run_manifest_sha256": sha256_bytes(written["quant_run_manifest.json"].encode()),
            "files_sha256": listed["files_sha256"]}


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
