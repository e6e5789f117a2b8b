"""Stages under faults: quantize-drafter killed with SIGKILL, a full disk under the cache stage,
and flipped bytes in a real run (cache shard, checkpoint, manifest, provenance) caught by the reader
or `python -m pipeline verify`.

The cache stage's own kill tests are in tests/test_cache_faults.py; publish's in
tests/test_publish_faults.py; verify's per-file flips on a hand-built run in tests/test_verify.py.
Here everything runs on one real run of the fixture world (the golden fixtures' target + drafter):
data -> cache -> quantize-drafter (nvfp4, a subprocess: the uninterrupted reference) -> manifest.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.core.io import read_json
from tests import warm
from tests._support import ENV, REPO, leftovers, outputs, overrides, quantize_cli, run_main


@pytest.fixture(scope="module")
def run(tiny_run) -> dict:
    """The session's one real run of the fixture world (tests/conftest.py)."""
    return tiny_run


# ---------------------------------------------------------------- SIGKILL of quantize-drafter
KILLPOINTS = {
    # the bf16 reference checkpoint is complete in drafter/.partial-bf16-<pid>/, not yet renamed
    "saving_bf16_reference": "pipeline.core.io:_fsync_tree|1",
    # oneshot is calibrating: the third calibration forward of the drafter
    "during_oneshot": "pipeline.models.dflash:DFlashDrafter.forward|3",
    # the compressed checkpoint is written in drafter/.partial-nvfp4-<pid>/, its config not yet rewritten
    "saving_quantized_checkpoint": "pipeline.quant.export:rewrite_config|1",
}


@pytest.mark.faults("kill")
@pytest.mark.parametrize("point", list(KILLPOINTS))
def test_quantize_drafter_sigkill_then_rerun(point, run, tmp_path):
    """quantize-drafter SIGKILLed at this point, then re-run: its files equal an uninterrupted run's sha256s, no temp or partial dir left."""
    runs = tmp_path / "runs"
    shutil.copytree(run["template"], runs / "qw")
    marker = tmp_path / "reached"
    proc = quantize_cli(runs, tmp_path / "tmp", f"{KILLPOINTS[point]}|{marker}")
    deadline = time.time() + 240
    while not marker.exists():
        assert proc.poll() is None, f"exited before the kill point: {proc.stderr.read()[-3000:]}"
        assert time.time() < deadline, "never reached the kill point"
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    qw = runs / "qw"
    assert not (qw / "drafter" / "nvfp4").exists(), "a variant dir is visible before it is complete"
    assert not (qw / "stages" / "quantize-drafter-nvfp4.json").exists()
    if point != "during_oneshot":
        assert leftovers(qw), "the kill should leave the partial checkpoint dir the next run must clean"

    # the re-run: the same entry point in this process (the kill above is the real process), with what
    # quantize_cli gives its process (one thread, offline, its own TMPDIR)
    rc, _, err = run_main("quantize-drafter", *overrides(runs), env={
        "TMPDIR": str(tmp_path / "tmp"), **{k: ENV[k] for k in ("OMP_NUM_THREADS", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}})
    assert rc == 0, err[-3000:]
    assert outputs(qw) == run["outputs"]
    assert leftovers(qw) == []
    assert (qw / "stages" / "quantize-drafter-nvfp4.json").is_file()
    _TMPDIR_LEFT[point] = sorted(p.name for p in (tmp_path / "tmp").glob("specquant-*"))


_TMPDIR_LEFT: dict[str, list[str]] = {}  # per kill point: what the killed run left in $TMPDIR


@pytest.mark.faults("kill")
def test_killed_quantize_drafter_leaves_nothing_in_tmpdir():
    """After the SIGKILLs above and their re-runs, nothing the stage created is left in $TMPDIR either."""
    if not _TMPDIR_LEFT:
        pytest.skip("runs after test_quantize_drafter_sigkill_then_rerun")
    assert {k: v for k, v in _TMPDIR_LEFT.items() if v} == {}


# ---------------------------------------------------------------- a full disk under the cache stage
@contextlib.contextmanager
def small_disk(path: Path, size_kb: int):
    """A tmpfs of `size_kb` at path (root, where mount works); yields a function that grows it, or
    None where tmpfs cannot be mounted (the caller then limits the file size instead)."""
    path.mkdir(parents=True)
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(path)],
                        capture_output=True).returncode == 0 if os.geteuid() == 0 else False

    def grow(mb: int = 64) -> None:
        subprocess.run(["mount", "-o", f"remount,size={mb}m", str(path)], check=True)

    try:
        yield grow if ok else None
    finally:
        if ok:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _limit_file_size(nbytes: int):
    def preexec() -> None:  # over the limit, write() fails with EFBIG instead of the process dying
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return preexec


@pytest.mark.faults("disk_full")
def test_cache_stage_on_a_full_disk_then_resume(tmp_path):
    """The disk fills during the cache stage: one `error:` line naming the file; finished shards stay; a re-run with space completes with the same content hash."""
    from tests._support import run_cache, stage_overrides, write_data

    write_data(tmp_path / "ref", n=10)
    ref = run_cache(tmp_path / "ref")
    with small_disk(tmp_path / "disk", 72) as grow:
        run_dir = tmp_path / "disk" / "run"
        write_data(run_dir, n=10)
        cmd = [sys.executable, "-m", "pipeline", "cache", *stage_overrides(run_dir)]
        if grow:  # a real filesystem that small: the stage's process forks from the warm launcher
            full = warm.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
        else:  # a file-size limit, set in the child before its exec
            full = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300,
                                  preexec_fn=_limit_file_size(16 * 1024))
        errors = [ln for ln in full.stderr.splitlines() if ln.startswith("error:")]
        assert full.returncode == 2, full.stderr[-3000:]
        assert "Traceback" not in full.stderr and len(errors) == 1, full.stderr[-3000:]
        assert str(run_dir / "cache" / "shard-") in errors[0] and "no space left" in errors[0], errors[0]
        cache = run_dir / "cache"
        assert not (cache / "index.json").exists() and leftovers(run_dir) == []
        finished = sorted(p.name for p in cache.glob("shard-*.json"))
        assert len(finished) < ref["num_shards"]

        if grow:
            grow()
        # the re-run with space: the same entry point in this process, with the environment `cmd` had
        rc, _, err = run_main(*cmd[3:], env={k: ENV[k] for k in ("OMP_NUM_THREADS", "HF_HUB_OFFLINE",
                                                                 "TRANSFORMERS_OFFLINE")})
        assert rc == 0, err[-3000:]
        index = read_json(cache / "index.json")
        assert index["content_hash"] == ref["content_hash"]
        record = read_json(run_dir / "stages" / "cache.json")
        assert record["result"]["shards_written"] == ref["num_shards"] - len(finished)  # finished work was kept
        assert leftovers(run_dir) == []


# ---------------------------------------------------------------- a full disk under quantize-drafter's safetensors write
def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


@pytest.mark.faults("disk_full")
def test_quantize_drafter_on_a_full_disk_then_rerun(run, tmp_path):
    """The disk fills as safetensors writes quantize-drafter's checkpoint (save_pretrained; safetensors raises its own SafetensorError): one `error:` line naming the variant folder, exit 2, no traceback, nothing partial; a re-run with space writes the reference's files."""
    writer = "transformers.modeling_utils:safe_save_file"  # the call that writes drafter/<v>/model.safetensors
    room_kb = (_tree_bytes(run["template"]) >> 10) + 64 * 1024  # the run, and room for every write before that one
    with small_disk(tmp_path / "disk", room_kb) as grow:
        runs = tmp_path / "disk" / "runs"
        shutil.copytree(run["template"], runs / "qw")
        qw = runs / "qw"
        # a real full file system where one can be mounted, else a real file-size limit (EFBIG, the same sentence)
        fault = f"fill={writer}:{tmp_path / 'disk'}" if grow else f"fsize={writer}:4096"
        cmd = [sys.executable, "-m", "tests.faults", fault, "--", "-m", "pipeline", "quantize-drafter", *overrides(runs)]
        full = warm.run(cmd, cwd=REPO, env={**ENV, "TMPDIR": str(tmp_path)}, capture_output=True, text=True,
                        timeout=300)
        errors = [ln for ln in full.stderr.splitlines() if ln.startswith("error:")]
        assert full.returncode == 2, full.stderr[-3000:]
        assert "Traceback" not in full.stderr and len(errors) == 1, full.stderr[-3000:]
        assert f"no space left to write {qw / 'drafter' / 'nvfp4'} (" in errors[0], errors[0]
        assert "point runs_root at a larger disk" in errors[0] or not grow, errors[0]  # the key the user set
        assert not (qw / "drafter" / "nvfp4").exists() and not (qw / "stages" / "quantize-drafter-nvfp4.json").exists()
        assert leftovers(qw) == []

        (tmp_path / "disk" / "filler").unlink(missing_ok=True)  # space again
        rc, _, err = run_main("quantize-drafter", *overrides(runs), env={
            "TMPDIR": str(tmp_path), **{k: ENV[k] for k in ("OMP_NUM_THREADS", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}})
        assert rc == 0, err[-3000:]
        assert outputs(qw) == run["outputs"]
        assert leftovers(qw) == []


# ---------------------------------------------------------------- a full disk under every other writing stage
def _files(root: Path) -> dict[str, str]:
    """{run-relative path: sha256} of every file under root (directories, empty or not, aside)."""
    from pipeline.core.io import sha256_file

    return {p.relative_to(root).as_posix(): sha256_file(p, reuse=False) for p in sorted(root.rglob("*"))
            if p.is_file()} if root.is_dir() else {}


# stage -> (the runs root copied onto the small disk: none | blend | pristine (the publish tests' run: cache,
# quantize-drafter nvfp4, evaluate, manifest), the call before which the disk fills (`<module>:<function>`,
# looked up at call time), the run-relative path the sentence names, the files whose bytes the re-run gives again
# (evaluate's name the run's paths, so its tau table is compared instead))
FULL_DISK = {
    # data/samples.jsonl, the first of the stage's three atomic files (hashed while written)
    "data": ("none", "pipeline.artifacts.samples:write", "data/samples.jsonl", ("data/meta.json",)),
    # target/<v>/model.safetensors through compressed-tensors' save_pretrained (safetensors' own error type)
    "quantize-target": ("blend", "transformers.modeling_utils:safe_save_file", "target/w4a16", ()),
    # eval/results.json, after the prompts were rewritten (same bytes) and before report, plots and commands
    "evaluate": ("pristine", "pipeline.artifacts.eval_results:write_results", "eval/results.json", ()),
    # calibration_manifest.json, the first file the stage writes (both manifests validated before it)
    "manifest": ("pristine", "pipeline.artifacts.manifests:write", "calibration_manifest.json",
                 ("calibration_manifest.json",)),
    # publish/nvfp4/README.md inside the assembly folder, after the checkpoint and eval files were copied in
    "publish": ("pristine", "pipeline.provenance.modelcard:render", "publish/", ()),
}


def _full_disk_overrides(stage: str, runs: Path, tokenizer: Path) -> list[str]:
    from tests._support import HUB_BASE, HUB_TARGET, publish_overrides, target_w4a16_group, world_cfg

    if stage == "data":
        return [f"runs_root={runs}", "run_name=qw", "seed=3", f"target.tokenizer={tokenizer}", "data.num_samples=6"]
    if stage == "quantize-target":
        return world_cfg(runs, "target_quant=w4a16", f"target_quant.group_size={target_w4a16_group()}",
                         overrides_only=True)
    extra = [f"publish.base_model={HUB_BASE}", f"publish.target_model={HUB_TARGET}",
             "publish.namespace=specquant-test"] if stage == "publish" else []
    return [*publish_overrides(runs), *extra]


@pytest.mark.faults("disk_full")
@pytest.mark.parametrize("stage", list(FULL_DISK))
def test_writing_stage_on_a_full_disk_then_rerun(stage, pristine_runs, chat_tokenizer, tmp_path):
    """The disk fills while this stage writes its outputs: one `error:` line naming the file, exit 2, no traceback, the run directory's files as they were (no partial or temp file); a re-run with space succeeds."""
    from pipeline.artifacts.eval_results import read_results
    from pipeline.core.io import hash_tree
    from tests._support import PUBLISH_TOKEN, write_blend

    base, writer, named, compared = FULL_DISK[stage]
    src = pristine_runs if base == "pristine" else None
    room_kb = ((_tree_bytes(src) >> 10) if src else 0) + 64 * 1024  # the copied run, and room for what comes first
    with small_disk(tmp_path / "disk", room_kb) as grow:
        runs = tmp_path / "disk" / "runs"
        if src:
            shutil.copytree(src, runs, symlinks=True)
        elif base == "blend":
            write_blend(runs / "qw" / "data")
        else:
            runs.mkdir()
        ov = _full_disk_overrides(stage, runs, chat_tokenizer)
        run_dir = runs / ("tiny" if base == "pristine" else "qw")
        before = _files(run_dir)
        table = read_results(run_dir / "eval").table if stage == "evaluate" else None
        fault = f"fill={writer}:{tmp_path / 'disk'}" if grow else f"fsize={writer}:1024"
        env = {**ENV, "TMPDIR": str(tmp_path), "HF_TOKEN": PUBLISH_TOKEN}
        cmd = [sys.executable, "-m", "tests.faults", fault, "--", "-m", "pipeline", stage, *ov]
        full = warm.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        errors = [ln for ln in full.stderr.splitlines() if ln.startswith("error:")]
        assert full.returncode == 2, full.stderr[-3000:]
        assert "Traceback" not in full.stderr and len(errors) == 1, full.stderr[-3000:]
        print(f"{stage}: {errors[0]}")
        assert f"`{stage}`: no space left to write {run_dir / named}" in errors[0], errors[0]
        assert "point runs_root at a larger disk" in errors[0] or not grow, errors[0]  # the key the user set
        assert _files(run_dir) == before, "the failed stage changed or left files in the run directory"
        assert leftovers(run_dir) == []

        (tmp_path / "disk" / "filler").unlink(missing_ok=True)  # space again
        rc, _, err = run_main(stage, *ov, env={"TMPDIR": str(tmp_path), "HF_TOKEN": PUBLISH_TOKEN,
                                               **{k: ENV[k] for k in ("OMP_NUM_THREADS", "HF_HUB_OFFLINE",
                                                                      "TRANSFORMERS_OFFLINE")}})
        assert rc == 0, err[-3000:]
        assert leftovers(run_dir) == []
        record = "publish/nvfp4.json" if stage == "publish" else f"stages/{stage}" + (
            "-w4a16.json" if stage == "quantize-target" else ".json")
        assert (run_dir / record).is_file()
        after = _files(run_dir)
        for rel in compared:  # the same bytes as the uninterrupted run's
            assert after[rel] == (before.get(rel) or after[rel]), rel
        if stage == "evaluate":
            assert read_results(run_dir / "eval").table == table  # the pristine run's tau per variant and subset
        if stage == "quantize-target":
            assert set(hash_tree(run_dir / "target" / "w4a16")) >= {"config.json", "model.safetensors"}
        if stage == "publish":
            from pipeline.provenance.verify import verify_dir

            assert verify_dir(run_dir / "publish" / "nvfp4") == []


@contextlib.contextmanager
def _read_only_fs(path: Path):
    """A read-only tmpfs at path (root, where mount works), else the test is skipped: a root process
    writes through any permission bits, so only a read-only file system refuses it."""
    path.mkdir(parents=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a read-only file system")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.mark.faults("bad_input")
@pytest.mark.parametrize("key", ["run_dir", "runs_root"])
def test_a_read_only_run_directory_names_the_key_that_placed_it(key, tmp_path):
    """The run directory lies on a read-only file system: one `error:` line, exit 2, naming the path and the key the user set (run_dir or runs_root), never the other."""
    with _read_only_fs(tmp_path / "ro") as ro:
        where = ro / "run" if key == "run_dir" else ro
        rc, _, err = run_main("data", f"{key}={where}", "run_name=qw")
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert rc == 2 and "Traceback" not in err and len(errors) == 1, err[-3000:]
    other = "runs_root" if key == "run_dir" else "run_dir"
    assert f"could not write {ro}" in errors[0] and "Read-only file system" in errors[0], errors[0]
    assert f"point {key} at a writable file system" in errors[0] and f"{other} " not in errors[0], errors[0]


# ---------------------------------------------------------------- flipped bytes in a real run
def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _copy(run: dict, tmp_path: Path) -> Path:
    dst = tmp_path / "runs" / "qw"
    shutil.copytree(run["reference"], dst)
    return dst


TAMPERED = {
    "cache_shard": "cache/shard-00001.safetensors",
    "checkpoint": "drafter/nvfp4/model.safetensors",
    "calibration_manifest": "calibration_manifest.json",
    "quant_run_manifest": "quant_run_manifest.json",
    "provenance_commands": "provenance/commands.sh",
    "provenance_attestation": "provenance/attestation.intoto.json",
}


@pytest.mark.faults("tamper")
@pytest.mark.parametrize("what", list(TAMPERED))
def test_verify_names_a_flipped_byte_in_a_real_run(what, run, tmp_path, capsys):
    """One byte flipped in this file of a real pipeline run: `python -m pipeline verify` fails naming it."""
    from pipeline.__main__ import main

    qw = _copy(run, tmp_path)
    assert main(["verify", str(qw)]) == 0, capsys.readouterr().out
    capsys.readouterr()
    _flip(qw / TAMPERED[what])
    assert main(["verify", str(qw)]) == 1
    out = capsys.readouterr().out
    assert f"verify: {TAMPERED[what]}:" in out and "FAILED" in out, out


@pytest.mark.faults("tamper")
def test_flipped_shard_stops_the_next_stage_naming_it(run, tmp_path, capsys):
    """A flipped byte in a cache shard: quantize-drafter (the cache's reader) stops with one line naming the shard, writing no variant."""
    from pipeline.__main__ import main

    qw = _copy(run, tmp_path)
    for shard in sorted((qw / "cache").glob("shard-*.safetensors")):
        _flip(shard)
    rc = main(["quantize-drafter", *overrides(tmp_path / "runs", "quant.name=nvfp4-again")])
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert rc == 2 and len(errors) == 1, err[-3000:]
    assert "shard-0000" in errors[0] and "sha256" in errors[0], errors[0]
    assert not (qw / "drafter" / "nvfp4-again").exists() and leftovers(qw) == []
