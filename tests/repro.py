"""`python -m tests.repro` (`make repro-check`): run the tiny pipeline twice from scratch and compare.

Both runs use the same config and seed, into `<workdir>/a` and `<workdir>/b` (runs_root). Every output
file's sha256 is compared, after these documented exclusions and normalizations, which are printed:

- EXCLUDED files (their content legitimately differs): `stages/*.json` (start time, wall time, argv),
  `.work/*` (scratch: the hash memo, `pipeline/core/hashes.py`),
  `eval/timings.json` (wall-clock seconds and speedups), `publish/*.json` (publish records: they
  carry the folder's files_sha256 and a tag derived from it; the folder itself is compared file by file).
- NORMALIZED text: the runs root path (and the checkout path) is replaced by `<RUNS_ROOT>` (`<REPO>`)
  in every UTF-8 file, since commands and resolved configs capture where the run lived.
- NORMALIZED JSON fields: the manifests' `timing` section; the statement's
  `predicate.runDetails.metadata.{startedOn,finishedOn}` and its subject digests; the file lists'
  per-file digests and files_sha256 (each of those files is compared directly instead).

Then, if a reference exists (`manifests/tiny/`, written by `--update-reference`), the computed outputs
(data/, cache/, drafter/, target/, checks/, eval/ and the two manifests without environment, git and
timing) are compared with it. The reference records the machine fingerprint (CPU model, torch and its
CPU capability): a mismatch on another fingerprint is a warning listing the files, on the same
fingerprint a failure.

It also fails on any warning a stage prints that the README does not explain, and on any file the stages
left in their own HOME and TMPDIR (named in one sentence): every stage runs with a HOME and TMPDIR the check
creates under its workdir (`private_env`), so a file there is a stage's, and another program writing to the
machine's temp dir or home meanwhile cannot change the verdict. Per-user caches a tool builds there by design
are listed with their reasons in NOT_OURS.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path, PurePosixPath
from typing import Any

from pipeline.core.io import atomic_write_bytes, atomic_write_json, dumps_json, sha256_bytes
from pipeline.provenance import record as prov
from pipeline.stages import ORDER

EXCLUDED = {
    "stages/*.json": "stage records: start time, wall time and the captured argv",
    "eval/timings.json": "wall-clock seconds and speedups of the evaluation",
    "publish/*.json": "publish records: files_sha256 and tag of the folder, which is compared file by file",
    ".work/*": "the run's scratch: the hash memo (pipeline/core/hashes.py), file identities and times, never an output",
}
DIGEST_LISTS = ("provenance/files.sha256.json", "provenance/attestation.intoto.json")
TIMING_FIELDS = {"calibration_manifest.json": [("timing",)], "quant_run_manifest.json": [("timing",)],
                 "provenance/attestation.intoto.json": [("predicate", "runDetails", "metadata", "startedOn"),
                                                        ("predicate", "runDetails", "metadata", "finishedOn")]}
# fields that name the machine or the commit rather than the computation: dropped only against the reference
MACHINE_FIELDS = [("environment",), ("stages",), ("checkpoints", "*", "stage"), ("source",)]
REFERENCE_PARTS = ("data/", "cache/", "cache-", "drafter/", "target/", "checks/", "eval/")
# `make all`'s order, from the one stage list; cache-pair = the cache on the quantized target
# (cache.target=<pair target>), right after that target is made; serve-check needs a GPU and vLLM
STAGES = tuple(s for name in ORDER if name != "serve-check"
               for s in ((name, "cache-pair") if name == "quantize-target" else (name,)))


# ---------------------------------------------------------------- normalization
def excluded(rel: str) -> str | None:
    """Why a file is left out of the comparison (patterns match path segments from the right, so they
    also cover the copies inside publish/<variant>/), or None."""
    for pat, why in EXCLUDED.items():
        if PurePosixPath(rel).match(pat) and (not pat.startswith("publish/") or rel.count("/") == 1):
            return why
    return None


def _drop(obj: Any, path: tuple[str, ...]) -> None:
    if not path or obj is None:
        return
    head, rest = path[0], path[1:]
    items = (obj if isinstance(obj, list) else []) if head == "*" else None
    if items is not None:
        for it in items:
            _drop(it, rest)
    elif isinstance(obj, dict) and head in obj:
        if rest:
            _drop(obj[head], rest)
        else:
            obj[head] = "<excluded>"


def normalized(root: Path, rel: str, roots: list[str], machine: bool = False) -> bytes:
    """The bytes compared for one file: raw for binaries, path- and timing-normalized for text/JSON."""
    data = (root / rel).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return data
    for r, name in sorted(((r, n) for r, n in roots), key=lambda x: -len(x[0])):
        text = text.replace(r, name)
    inner = rel.split("/", 2)[-1] if rel.startswith("publish/") and rel.count("/") >= 2 else rel
    if not rel.endswith(".json") or (inner not in TIMING_FIELDS and inner not in DIGEST_LISTS and not machine):
        return text.encode()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return text.encode()
    for path in TIMING_FIELDS.get(inner, []) + (MACHINE_FIELDS if machine else []):
        _drop(doc, path)
    if inner == prov.FILE_LIST:
        doc["files_sha256"] = "<excluded>"
        for e in doc.get("files", {}).values():
            e["sha256"], e["bytes"] = "<compared per file>", "<compared per file>"
    if inner == prov.ATTESTATION:
        for s in doc.get("subject", []):
            s["digest"] = "<compared per file>"
    return dumps_json(doc).encode()


def digests(run_dir: Path, runs_root: Path, machine: bool = False) -> tuple[dict[str, str], dict[str, str]]:
    """({file: sha256 of its normalized bytes}, {file: why excluded}) for every file of a run."""
    roots = [(str(runs_root.resolve()), "<RUNS_ROOT>"), (str(runs_root), "<RUNS_ROOT>"),
             (str(prov.REPO_ROOT), "<REPO>")]
    out, skipped = {}, {}
    for rel in prov.list_files(run_dir):
        why = excluded(rel)
        if why:
            skipped[rel] = why
        else:
            out[rel] = sha256_bytes(normalized(run_dir, rel, roots, machine))
    return out, skipped


def compare(a: dict[str, str], b: dict[str, str]) -> list[str]:
    diffs = [f"{r}: only in the first run" for r in sorted(set(a) - set(b))]
    diffs += [f"{r}: only in the second run" for r in sorted(set(b) - set(a))]
    diffs += [f"{r}: differs ({a[r][:12]}... vs {b[r][:12]}...)" for r in sorted(set(a) & set(b)) if a[r] != b[r]]
    return diffs


# ---------------------------------------------------------------- running the pipeline
def steps(stages: list[str], quants: list[str], pair_target: str, pair_quants: list[str],
          target_quants: list[str] | None = None) -> list[tuple[str, list]]:
    """(stage, its extra overrides) in order, as `make all` runs them; `pair_target` may name several targets
    (space-separated, Makefile PAIR_TARGET), `target_quants` the targets written after the default one."""
    out = []
    pairs = str(pair_target or "").split()
    # `<target>:<quant>` entries are that target's own recipes (Makefile PAIR_QUANTS_<target>); the plain ones
    # serve every pair target without its own
    own: dict[str, list[str]] = {}
    for q in pair_quants:
        if ":" in q:
            own.setdefault(q.split(":", 1)[0], []).append(q.split(":", 1)[1])
    plain = [q for q in pair_quants if ":" not in q]
    for stage in stages:
        if stage == "quantize-drafter":
            # one process per sweep (`-m quant=a,b`), as `make all` runs them
            out += [(stage, ["-m", f"quant={','.join(quants)}"])] if quants else []
            out += [(stage, ["-m", f"quant={','.join(own.get(t, plain))}", f"quant.calibration_target={t}"])
                    for t in pairs if own.get(t, plain)]
        elif stage == "quantize-target":
            out += [(stage, [])] + [(stage, [f"target_quant={t}"]) for t in target_quants or []]
        elif stage == "cache-pair":
            out += [("cache", ["-m", f"cache.target={','.join(pairs)}"])] if pairs else []
        else:
            out.append((stage, []))
    return out


# warnings the README explains (the served-pair section): one sentence each, by design
EXPLAINED_WARNINGS = (
    (re.compile(r"^warning: (evaluate|serve-check|publish): drafter `[^`]+` was calibrated on the hidden states of "
                r"target `[^`]+`"), "pairing: a drafter paired with a target other than the one it was calibrated on"),
    (re.compile(r"WARNING - Overriding weight observer for lower memory usage \((static_minmax|minmax|mse) -> "
                r"memoryless_\w+\)$"), "llm-compressor: a weight observer runs once per layer, so its memoryless "
                                      "twin computes the same scales"),
)
_WARNING = re.compile(r"warn", re.IGNORECASE)  # warning, Warning, UserWarning, warnings.warn(


def warning_lines(text: str) -> tuple[list[str], dict[str, int]]:
    """(warnings the README does not explain, {explained class: count}) in a stage's output."""
    unexplained, explained = [], {}
    for line in re.split(r"[\r\n]+", text):
        line = line.strip()
        if not line or not _WARNING.search(line):
            continue
        why = next((w for pat, w in EXPLAINED_WARNINGS if pat.search(line)), None)
        if why:
            explained[why] = explained.get(why, 0) + 1
        else:
            unexplained.append(line)
    return unexplained, explained


# The stages run with a HOME and a TMPDIR of their own (`private_env`: folders the check creates, empty, under its
# workdir), so what is left there is the stages' alone: another program writing to the machine's temp dir or home
# while the check runs cannot change its verdict. Files a tool keeps there per user by design (built by the first
# stage that imports it, reused by every later one, never one run's leftover) are not counted:
# {pattern of the path relative to the private HOME or TMPDIR (fnmatch; a folder covers all below it): why}
NOT_OURS = {
    # matplotlib's font list: built once in the private HOME on its first import and reused by every later stage
    # (the same system fonts, so the same list and the same plots as with the user's own cache)
    ".cache/matplotlib": "matplotlib's per-user font cache, built once on its first import",
    ".config/matplotlib": "matplotlib's per-user config folder, created once on its first import",
}
# where tools put per-user caches when told so by the environment: unset for the stages, so that each lands in the
# private HOME (HF_HOME is set there: the tiny world reads no Hub cache and runs offline)
MOVED_VARS = ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE",
              "HF_XET_CACHE", "HF_ASSETS_CACHE", "MPLCONFIGDIR", "TORCH_HOME", "TORCHINDUCTOR_CACHE_DIR",
              "TRITON_CACHE_DIR", "PIP_CACHE_DIR", "TMPDIR", "TMP", "TEMP")


def private_env(work: Path) -> tuple[dict[str, str], list[Path]]:
    """(the stages' environment, [their HOME, their TMPDIR]): this environment with HOME and TMPDIR (TMP, TEMP)
    pointing at new empty folders under `work`/env/, the per-user cache variables (MOVED_VARS, XDG_*) unset or
    moved there, git still reading the user's global config (so the provenance's git state is the same), and
    the offline, seeded settings every stage runs with."""
    import shutil

    home, tmp = work / "env" / "home", work / "env" / "tmp"
    shutil.rmtree(work / "env", ignore_errors=True)  # the check's own (a --workdir used before): made empty
    for d in (home, tmp):
        d.mkdir(parents=True)  # whatever is found there at the end, a stage wrote
    env = {k: v for k, v in os.environ.items() if k not in MOVED_VARS and not k.startswith("XDG_")}
    gitconfig = Path(os.environ.get("GIT_CONFIG_GLOBAL") or Path.home() / ".gitconfig")
    if gitconfig.is_file():
        env["GIT_CONFIG_GLOBAL"] = str(gitconfig)
    env.update(HOME=str(home), TMPDIR=str(tmp), TMP=str(tmp), TEMP=str(tmp), HF_HOME=str(home / ".cache" / "huggingface"),
               PYTHONHASHSEED="0", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    return env, [home, tmp]


def not_ours(rel: str) -> str | None:
    """Why `rel` (relative to the private HOME or TMPDIR) is not a leftover of ours, or None."""
    import fnmatch

    return next((why for pat, why in NOT_OURS.items() if fnmatch.fnmatch(rel, pat) or fnmatch.fnmatch(rel, pat + "/*")),
                None)


def files_left(roots: list[Path]) -> list[str]:
    """Every file (or link) under the stages' private HOME and TMPDIR (`roots`), except what NOT_OURS names."""
    found = []
    for root in roots:
        root = root.resolve()
        for dirpath, dirnames, filenames in os.walk(root):
            here = Path(dirpath)
            dirnames[:] = [d for d in dirnames if not not_ours((here / d).relative_to(root).as_posix())]
            found += [str(here / n) for n in filenames if not not_ours((here / n).relative_to(root).as_posix())]
    return sorted(found)


def leftover_sentence(files: list[str]) -> str | None:
    """The failure in one sentence naming the files, or None when nothing was left."""
    if not files:
        return None
    shown = ", ".join(files[:5]) + (f" and {len(files) - 5} more" if len(files) > 5 else "")
    return (f"repro-check: FAILED: {len(files)} file(s) were left in the stages' private HOME or TMPDIR ({shown}); "
            "remove what writes them or point it into the run's .work/, or, for a per-user cache of a tool that "
            "is not ours, add it with its reason to tests.repro.NOT_OURS")


def run_pipeline(runs_root: Path, overrides: list[str], quants: list[str], stages: list[str],
                 pair_target: str = "", pair_quants: list[str] | None = None,
                 warnings_seen: dict | None = None, env: dict[str, str] | None = None,
                 target_quants: list[str] | None = None) -> float:
    """Every step of `stages` in order, each `python -m pipeline` in a process of its own with `env`
    (`private_env`'s; default: this environment with the offline, seeded settings)."""
    if env is None:
        env = {**os.environ, "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    started = time.time()
    for stage, extra in steps(stages, quants, pair_target, list(pair_quants or []), list(target_quants or [])):
        argv = [sys.executable, "-m", "pipeline", stage, f"runs_root={runs_root}", *extra, *overrides]
        print(f"[repro] {' '.join(argv[2:])}", flush=True)
        proc = subprocess.run(argv, cwd=prov.REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        text = proc.stdout.decode("utf-8", errors="replace")
        sys.stdout.write(text)
        sys.stdout.flush()
        if warnings_seen is not None:
            unexplained, explained = warning_lines(text)
            warnings_seen.setdefault("unexplained", []).extend(f"{stage}: {w}" for w in unexplained)
            for why, n in explained.items():
                warnings_seen.setdefault("explained", {})[why] = warnings_seen.get("explained", {}).get(why, 0) + n
        if proc.returncode != 0:
            raise SystemExit(f"repro-check: stage {stage} {' '.join(extra)} failed in {runs_root}")
    return time.time() - started


def fingerprint() -> dict[str, Any]:
    import torch

    model = platform.processor()
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    fp = {"machine": platform.machine(), "cpu": model, "torch": torch.__version__,
          "cpu_capability": torch.backends.cpu.get_cpu_capability(),
          "cuda": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    return {**fp, "id": sha256_bytes(dumps_json(fp).encode())[:16]}


def _reference_view(run_dir: Path, runs_root: Path) -> dict[str, str]:
    d, _ = digests(run_dir, runs_root, machine=True)
    return {r: h for r, h in d.items()
            if r.startswith(REFERENCE_PARTS) or r in ("calibration_manifest.json", "quant_run_manifest.json")}


def check_reference(ref_dir: Path, view: dict[str, str]) -> int:
    ref = json.loads((ref_dir / "outputs.sha256.json").read_text(encoding="utf-8"))
    diffs = compare(ref["files"], view)
    fp = fingerprint()
    if not diffs:
        print(f"[repro] matches the reference {ref_dir} ({len(view)} files)")
        return 0
    same = ref["fingerprint"]["id"] == fp["id"]
    for d in diffs:
        print(f"[repro] reference {'FAIL' if same else 'warning'}: {d}")
    if same:
        print(f"[repro] FAILED: {len(diffs)} file(s) differ from {ref_dir} on the same machine fingerprint {fp['id']}")
        return 1
    print(f"[repro] warning: {len(diffs)} file(s) differ from {ref_dir}, recorded on another machine "
          f"({ref['fingerprint']['cpu']}, {ref['fingerprint']['cpu_capability']}; this one: {fp['cpu']}, "
          f"{fp['cpu_capability']}); floating point may differ between CPU types")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.repro", description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", help="where the two runs go (default: a new temporary directory)")
    ap.add_argument("--quants", default="nvfp4 nvfp4-nocalib nvfp4a16 nvfp4a16-gptq w4a16 w4a16-gptq w4a16-imatrix "
                    "fp8 fp8-minmax fp8-dynamic fp8-block", help="drafter variants to quantize")
    ap.add_argument("--target-quants", default="fp8", help="quantized targets written after the default one")
    ap.add_argument("--pair-target", default="w4a16 fp8",
                    help="quantized targets whose states are cached too, space-separated ('' = none)")
    ap.add_argument("--pair-quants", default="w4a16-gptq w4a16-imatrix fp8:fp8",
                    help="drafter variants also calibrated on each pair target's states (<target>:<quant> = only "
                         "on that target, which then takes no plain entry)")
    ap.add_argument("--stages", default=" ".join(STAGES), help="stages to run, in order")
    ap.add_argument("--reference", default=str(prov.REPO_ROOT / "manifests" / "tiny"))
    ap.add_argument("--update-reference", action="store_true", help="write the reference from the first run")
    ap.add_argument("--keep", action="store_true", help="keep the two runs after a success")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every stage (same for both runs)")
    args = ap.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="specquant-repro-")).resolve()
    from pipeline.core.config import compose

    run_name = str(compose(args.overrides).run_name)
    runs = {}
    seen: dict = {}
    env, private = private_env(work)  # the stages' own HOME and TMPDIR, judged at the end
    for side in ("a", "b"):
        root = work / side
        secs = run_pipeline(root, args.overrides, args.quants.split(), args.stages.split(), args.pair_target,
                            args.pair_quants.split(), seen, env, args.target_quants.split())
        print(f"[repro] run {side}: {secs:.0f}s -> {root / run_name}", flush=True)
        runs[side] = (root / run_name, root)
    (da, skipped), (db, _) = digests(*runs["a"]), digests(*runs["b"])
    for pat, why in EXCLUDED.items():
        n = sum(1 for r in skipped if skipped[r] == why)
        print(f"[repro] excluded {n} file(s) matching {pat}: {why}")
    print("[repro] normalized: runs root -> <RUNS_ROOT>, checkout -> <REPO>; JSON fields: "
          + "; ".join(f"{f}: {', '.join('.'.join(p) for p in ps)}" for f, ps in TIMING_FIELDS.items())
          + "; digests inside " + ", ".join(DIGEST_LISTS))
    diffs = compare(da, db)
    for d in diffs:
        print(f"[repro] FAIL: {d}")
    rc = 1 if diffs else 0
    # what the runs printed: every warning is one the README explains
    for why, n in sorted((seen.get("explained") or {}).items()):
        print(f"[repro] {n} explained warning(s): {why}")
    for w in seen.get("unexplained") or []:
        print(f"[repro] FAIL: a warning the README does not explain: {w[:300]}")
    rc = max(rc, 1 if seen.get("unexplained") else 0)
    print(f"[repro] warnings: {len(seen.get('unexplained') or [])} unexplained")
    # and nothing was left in the stages' own HOME and TMPDIR (another program's files elsewhere are not judged)
    outside = files_left(private)
    for f in outside[:20]:
        print(f"[repro] left in the stages' private HOME or TMPDIR: {f}")
    print(f"[repro] files left in the stages' private HOME and TMPDIR ({', '.join(map(str, private))}): "
          f"{len(outside)} (not counted: " + "; ".join(f"{pat}: {why}" for pat, why in NOT_OURS.items()) + ")")
    if (left := leftover_sentence(outside)) is not None:
        print(f"[repro] {left}")
        rc = 1
    print(f"[repro] {'FAILED' if diffs else 'OK'}: {len(da) - len(diffs)} of {len(set(da) | set(db))} files identical")
    ref = Path(args.reference)
    view = _reference_view(*runs["a"])
    if args.update_reference:
        atomic_write_json(ref / "outputs.sha256.json", {"fingerprint": fingerprint(), "files": view})
        for name in ("calibration_manifest.json", "quant_run_manifest.json"):
            atomic_write_bytes(ref / name, (runs["a"][0] / name).read_bytes().replace(
                str(runs["a"][1]).encode(), b"<RUNS_ROOT>"))
        print(f"[repro] wrote the reference {ref}")
    elif (ref / "outputs.sha256.json").is_file():
        rc = max(rc, check_reference(ref, view))
    if rc == 0 and not args.keep and not args.workdir:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
