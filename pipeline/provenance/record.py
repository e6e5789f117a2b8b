"""The run's `provenance/` folder and the file lists that `verify` checks.

Everything here is derived from what was captured while the stages ran
(`stages/*.json`, written by `pipeline.stages.runner`) and from the files on disk;
nothing is reconstructed from the current configuration.

    provenance/
      commands.json, commands.sh       captured argv + overrides of every stage, in pipeline order
      resolved_config/<record>.yaml    OmegaConf.to_yaml(resolve=True) of each stage's config
      source/                          the pipeline/ and conf/ files of this checkout, SOURCE.json
                                       (their sha256, git commit, dirty flag), git.diff when dirty
      vllm_serve.sh, eval_commands.sh  how to serve / evaluate each drafter variant
      attestation.intoto.json          in-toto Statement v1 + SLSA provenance v1 over every output file
      files.sha256.json                the folder's own file list (see below)

The file list rule (a run directory and a published repo folder carry the same thing):
`provenance/files.sha256.json` = {"kind": "run" | "published", "files": {relative posix path:
{"sha256", "bytes"[, "origin"]}}, "schema": "specquant.files/v1", "files_sha256": sha256 of the
canonical JSON of the other fields}; its format, writer and reader are `pipeline/artifacts/file_list.py`.
It lists every regular file under the folder except itself and temp files. In a run directory
it also leaves out what is written after the manifest stage: `stages/manifest.json`,
`stages/publish*.json` and `publish/` (each `publish/<variant>/` carries its own list), and the
run's scratch `.work/` (stages' temporary folders, the hash memo of `pipeline.core.hashes`).
In a published folder, "origin" is the run-relative path a file was copied from, so `verify`
can check it against the run's attestation. Write it last with `write_file_list`.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path
from typing import Any

from pipeline.artifacts import file_list, stage_record
from pipeline.artifacts.stage_record import StageRecord
from pipeline.core import hashes
from pipeline.core.io import (  # noqa: F401 - list_files, hash_files, TMP_PREFIX: the file list rule's pieces, used as prov.*
    TMP_PREFIX,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    dumps_json,
    hash_files,
    list_files,
    sha256_bytes,
    sha256_file,
)
from pipeline.core.secrets import scrub_config_text, scrub_obj, scrub_values
from pipeline.serving import command

REPO_ROOT = Path(__file__).resolve().parents[2]
FILE_LIST = file_list.PATH  # its format: pipeline/artifacts/file_list.py
ATTESTATION = "provenance/attestation.intoto.json"
# written after the manifest stage, so never part of the run's list or attestation
LATE_OUTPUTS = ("stages/manifest.json", "stages/publish", "publish/")
# a run's scratch: stages' temporary folders and the hash memo (`pipeline.core.hashes`, .work/hashes.json);
# never an output, so never listed either
SCRATCH = ".work/"

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
SLSA_PREDICATE = "https://slsa.dev/provenance/v1"
BUILD_TYPE = "https://github.com/specquant/specquant/blob/main/docs/ARCHITECTURE.md#pipeline-run-v1"
BUILDER_ID = "https://github.com/specquant/specquant/pipeline"


# ---------------------------------------------------------------- file lists and hashing
def is_late(rel: str) -> bool:
    """True for what a run's file list leaves out: the outputs written after the manifest stage, and scratch."""
    return any(rel == p or rel.startswith(p) for p in LATE_OUTPUTS) or rel.startswith(SCRATCH)


def write_file_list(folder: str | Path, kind: str = "published", origins: dict[str, str] | None = None,
                    files: dict[str, dict[str, Any]] | None = None) -> file_list.FileList:
    """Write `provenance/files.sha256.json` for `folder` (call it after the folder is complete) through its
    format's one writer (`pipeline.artifacts.file_list.write`); this decides what it lists.
    `files` (already hashed, e.g. by the manifest stage) saves re-reading a large run."""
    folder = Path(folder)
    # a published folder's signature (pipeline/provenance/signing.py) signs the list, so the list cannot name it
    skip = (lambda rel: rel == FILE_LIST or is_late(rel)) if kind == "run" else \
        (lambda rel: rel in (FILE_LIST, "model.sig"))
    files = {r: dict(e) for r, e in files.items()} if files is not None else hash_files(folder, list_files(folder, skip))
    for rel, origin in (origins or {}).items():
        if rel in files:
            files[rel]["origin"] = origin
    return file_list.write(folder, files, kind)


# ---------------------------------------------------------------- stage records
def load_records(run_dir: Path, order: tuple[str, ...] | list[str]) -> dict[str, StageRecord]:
    """{record name: record} for stages/*.json in pipeline order (`order`: the stage names in run order, the
    manifest stage passes `pipeline.stages.ORDER`), skipping the manifest's and publish's own records
    (`pipeline.artifacts.stage_record`, the one reader)."""
    return stage_record.load_records(run_dir, order)


def commands_doc(records: dict[str, StageRecord]) -> list[dict[str, Any]]:
    return [{"record": f"stages/{name}.json", "stage": rec.stage, "argv": rec.argv, "command": rec.command,
             "overrides": rec.overrides, "launcher": rec.launcher} for name, rec in records.items()]


def commands_sh(commands: list[dict[str, Any]]) -> str:
    lines = ["#!/usr/bin/env bash", "# The command lines of every stage of this run, as captured when they ran",
             "# (pipeline/stages/runner.py), in pipeline order. Run from the specquant checkout.", "set -euo pipefail", ""]
    previous = None
    for c in commands:
        lines.append(f"# {c['stage']} ({c['record']})")
        if c.get("argv") and c["argv"] == previous:  # a job of the `-m` sweep above: that line ran it too
            lines += [f"# ran by the command above (one job of its -m sweep): {c.get('command')}", ""]
            continue
        previous = c.get("argv")
        launcher = c.get("launcher") or {}
        if launcher.get("torchrun"):
            lines.append(f"# launched with torchrun, world size {launcher.get('world_size')}; same overrides:")
        if c.get("command"):
            lines.append(f"# portable form: {c['command']}")
        lines.append(shlex.join(c["argv"]) if c.get("argv") else f"# (no argv captured) {c.get('command')}")
        lines.append("")
    return "\n".join(lines)


def resolved_config_yaml(record: StageRecord) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(record.resolved_config), resolve=True)


# ---------------------------------------------------------------- source snapshot
def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, check=True,
                              timeout=30).stdout.decode("utf-8", "replace")
    except (OSError, subprocess.SubprocessError):
        return None


SOURCE_PATHS = ("pipeline", "conf", "pyproject.toml")


def source_files() -> list[str]:
    """The pipeline/ and conf/ files of this checkout (tracked + untracked, not ignored)."""
    listed = _git("ls-files", "-co", "--exclude-standard", "--", *SOURCE_PATHS)
    if listed is not None:
        rels = sorted({r for r in listed.splitlines() if r and (REPO_ROOT / r).is_file()})
    else:  # not a git checkout: fall back to walking the folders
        rels = [f"{top}/{r}" for top in SOURCE_PATHS[:2] for r in list_files(REPO_ROOT / top)] + ["pyproject.toml"]
    return [r for r in rels if "__pycache__" not in r and not r.endswith(".pyc")]


def source_tree_sha256() -> str:
    """One hash over the source files' names and contents (stage records may carry it to prove what ran)."""
    return sha256_bytes(dumps_json({r: sha256_file(REPO_ROOT / r) for r in source_files()}).encode())


def git_state(with_diff: bool = False) -> dict[str, Any]:
    """The checkout's commit and whether the source that runs differs from it (read-only git commands).

    Only SOURCE_PATHS count (pipeline/, conf/, pyproject.toml; never runs/, tests/, docs/). "dirty" means
    the working tree of those paths differs from HEAD (`git diff HEAD`: staged or not, deletions included)
    or holds untracked files that are not git-ignored; a change staged and then undone in the working tree
    does not count, since the working tree's bytes are what runs. Not a git checkout (or no git):
    commit and dirty are None. `with_diff` adds the diff text under "_diff" (for provenance/source/git.diff).
    """
    commit = (_git("rev-parse", "HEAD") or "").strip() or None
    if commit is None:
        return {"commit": None, "dirty": None, "untracked": [], **({"_diff": ""} if with_diff else {})}
    changed = (_git("diff", "HEAD", "--name-only", "--", *SOURCE_PATHS) or "").split()
    untracked = sorted((_git("ls-files", "-o", "--exclude-standard", "--", *SOURCE_PATHS) or "").split())
    out = {"commit": commit, "dirty": bool(changed or untracked), "untracked": untracked}
    if with_diff:
        out["_diff"] = (_git("diff", "HEAD", "--", *SOURCE_PATHS) or "") if changed else ""
    return out


def source_info() -> dict[str, Any]:
    """The source files' bytes and sha256, and `git_state` (commit, dirty flag, untracked files, diff)."""
    files, blobs = {}, {}
    for rel in source_files():
        data = (REPO_ROOT / rel).read_bytes()
        files[rel], blobs[rel] = {"sha256": sha256_bytes(data)}, data
        hashes.count_read(len(data), REPO_ROOT / rel)  # read for the snapshot, hashed from those bytes
    state = git_state(with_diff=True)
    diff = state.pop("_diff")
    tree = sha256_bytes(dumps_json({r: e["sha256"] for r, e in files.items()}).encode())
    return {"git": {**state, "diff": "git.diff" if diff.strip() else None},
            "files": files, "tree_sha256": tree, "_blobs": blobs, "_diff": diff}


def write_source_snapshot(dest: Path, info: dict[str, Any]) -> dict[str, Any]:
    """Copy the source files into dest with SOURCE.json (their sha256, git state) and git.diff when dirty."""
    files = {}
    for rel, data in info["_blobs"].items():
        entry = dict(info["files"][rel])
        try:
            text = data.decode("utf-8")
            clean = (scrub_config_text(text) if rel.endswith((".yaml", ".yml")) else scrub_values(text)).encode("utf-8")
        except UnicodeDecodeError:
            clean = data
        if clean != data:  # a secret in a source file is never copied out
            entry["redacted"] = True
        atomic_write_bytes(dest / rel, clean)
        files[rel] = entry
    if info["git"]["diff"]:
        atomic_write_text(dest / "git.diff", scrub_config_text(info["_diff"]))
    public = {"git": info["git"], "files": files, "tree_sha256": info["tree_sha256"]}
    atomic_write_json(dest / "SOURCE.json", public)
    return public


# ---------------------------------------------------------------- serving and evaluation commands
def vllm_serve_sh(target: dict, drafters: dict[str, tuple[int | None, bool]]) -> str:
    """One `vllm serve` per drafter variant ({variant: (num_speculative_tokens, quantized)}, as
    `pipeline.serving.command.drafter_settings` reads them), each the run's one serving command
    (`pipeline.serving.command`); drafter paths are relative to the run dir this script sits in."""
    tgt = target.get("path") or "<target>"
    lines = ["#!/usr/bin/env bash", "# Serve the target with each drafter variant of this run as its DFlash drafter.",
             "# Pick one variant: bash vllm_serve.sh <variant>. Needs an attention backend that supports",
             "# non-causal attention (e.g. flash_attn). A relative target path is relative to the specquant",
             "# checkout; drafter paths are inside this run directory.", "set -euo pipefail",
             'RUN_DIR="${RUN_DIR:-$(cd "$(dirname "$0")/.." && pwd)}"', 'VARIANT="${1:?usage: vllm_serve.sh <variant>}"',
             'case "$VARIANT" in']
    for variant, (k, quantized) in drafters.items():
        line = command.serve_command(tgt, f"$RUN_DIR/drafter/{variant}", k if k is not None else "<block_size-1>",
                                     quantized, target.get("revision"), variables=("RUN_DIR",))
        lines.append(f"  {shlex.quote(variant)}) exec {line} ;;")
    lines += ['  *) echo "unknown variant $VARIANT; choose one of: ' + " ".join(drafters) + '" >&2; exit 2 ;;', "esac", ""]
    return "\n".join(lines)


def _hydra_value(v: Any) -> str:
    if v is None:
        return "null"
    s = str(v)
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def eval_commands_sh(eval_record: StageRecord | None, eval_cfg: dict, vllm_commands: str | None) -> str:
    """Per-subset `python -m pipeline evaluate` commands (the captured overrides + one prompt set each)."""
    overrides = list(eval_record.overrides) if eval_record else []
    kept = [o for o in overrides if not o.lstrip("+~").startswith("eval.prompt_sets")]
    lines = ["#!/usr/bin/env bash", "# Per-subset evaluation commands of this run (run from the specquant checkout).",
             "# Each is the captured evaluate command restricted to one prompt set.", "set -euo pipefail", ""]
    if eval_record is None:
        lines.append("# (the evaluate stage has not run in this run: these use the configured prompt sets, no overrides)")
    for ps in eval_cfg.get("prompt_sets") or []:
        ordered = {"name": ps.get("name"), **ps}  # name first, for the reader
        fields = ",".join(f"{k}:{_hydra_value(v)}" for k, v in ordered.items() if v is not None)
        lines.append(f"# subset {ps.get('name')}")
        lines.append(shlex.join(["python", "-m", "pipeline", "evaluate", *kept, f"eval.prompt_sets=[{{{fields}}}]"]))
        lines.append("")
    if vllm_commands:
        lines += ["# ---- vLLM serving and benchmark commands (eval/vllm_commands.sh) ----", vllm_commands.rstrip("\n"), ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- in-toto / SLSA statement
def attestation(subjects: dict[str, dict], records: dict[str, StageRecord], dependencies: list[dict],
                source: dict, run_name: str) -> dict[str, Any]:
    starts = sorted(r.started_utc for r in records.values() if r.started_utc)
    last = records[list(records)[-1]] if records else None
    versions, git = (last.versions, last.git) if last else (None, None)
    predicate = {
        "buildDefinition": {
            "buildType": BUILD_TYPE,
            "externalParameters": {
                "run_name": run_name,
                "stages": {name: {"command": r.command, "overrides": r.overrides, "seed": r.seed}
                           for name, r in records.items()},
            },
            "internalParameters": {"versions": versions, "git": git,
                                   "source_tree_sha256": source.get("tree_sha256")},
            "resolvedDependencies": dependencies,
        },
        # timing lives only in runDetails.metadata (startedOn/finishedOn) so repro-check can drop it by name
        "runDetails": {"builder": {"id": BUILDER_ID, "version": {"specquant": (versions or {}).get("specquant")}},
                       "metadata": {k: v for k, v in (("invocationId", run_name),
                                                      ("startedOn", starts[0] if starts else None),
                                                      ("finishedOn", _finished(records))) if v is not None}},
    }
    return scrub_obj({"_type": STATEMENT_TYPE,
                      "subject": [{"name": rel, "digest": {"sha256": e["sha256"]}} for rel, e in sorted(subjects.items())],
                      "predicateType": SLSA_PREDICATE, "predicate": predicate})


def _finished(records: dict[str, StageRecord]) -> str | None:
    import datetime as dt

    ends = []
    for r in records.values():
        if r.started_utc and r.wall_time_s is not None:
            ends.append(dt.datetime.fromisoformat(r.started_utc) + dt.timedelta(seconds=float(r.wall_time_s)))
    return max(ends).isoformat() if ends else None
