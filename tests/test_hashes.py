"""Hash once (pipeline/core/hashes.py): a digest is reused while the file is unchanged, never after a change;
`verify` reads every byte regardless. Real stage runs (data, manifest) on the embedded tiny world."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core import hashes
from pipeline.core.io import atomic_write_bytes, sha256_bytes, sha256_file
from pipeline.provenance import record as provenance
from pipeline.provenance import verify
from tests import repro, warm
from tests._support import ENV, REPO


def _overrides(runs: Path) -> list[str]:
    return [f"runs_root={runs}", "run_name=h", "data.num_samples=12"]


def _record(run: Path, name: str) -> dict:
    return json.loads((run / "stages" / f"{name}.json").read_text(encoding="utf-8"))


def _stage(stage: str, ov: list[str]) -> None:
    r = warm.run([sys.executable, "-m", "pipeline", stage, *ov], cwd=REPO, env=ENV, capture_output=True,
                 text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def _flip_in_place(path: Path) -> os.stat_result:
    """One byte changed through the same inode, same size; returns the stat from before."""
    before = path.stat()
    with open(path, "r+b") as fh:
        fh.seek(before.st_size // 2)
        b = fh.read(1)
        fh.seek(before.st_size // 2)
        fh.write(bytes([b[0] ^ 0x01]))
    assert path.stat().st_size == before.st_size and path.stat().st_ino == before.st_ino
    return before


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, list[str]]:
    """data, then manifest, each its own process, as `make all` runs them."""
    ov = _overrides(tmp_path_factory.mktemp("hashes") / "runs")
    _stage("data", ov)
    _stage("manifest", ov)
    return Path(ov[0].split("=", 1)[1]) / "h", ov


def test_a_later_stage_reuses_the_recorded_hash_and_reads_none_of_the_file(run):
    rd, _ = run
    data, man = _record(rd, "data"), _record(rd, "manifest")
    for rec in (data, man):
        assert isinstance(rec["bytes_hashed"], int) and rec["bytes_hashed"] == sum(rec["hashed_files"].values())
        assert {"files", "bytes"} <= set(rec["hash_reused"])
    samples = rd / "data" / "samples.jsonl"
    # hashed while the data stage wrote it, so never read to hash: not by data, not by the manifest
    assert "data/samples.jsonl" not in data["hashed_files"] and "data/samples.jsonl" not in man["hashed_files"]
    assert not [f for f in man["hashed_files"] if f.startswith(("data/", "stages/"))], man["hashed_files"]
    assert man["hash_reused"]["bytes"] >= samples.stat().st_size
    # the digest it reused is the file's: the manifests list the true sha256
    listed = json.loads((rd / "provenance" / "files.sha256.json").read_text())["files"]
    assert listed["data/samples.jsonl"]["sha256"] == sha256_bytes(samples.read_bytes())
    # the memo is scratch: in no list, and the run verifies
    assert not [f for f in listed if f.startswith(".work/")] and (rd / ".work" / "hashes.json").is_file()
    assert repro.excluded(".work/hashes.json") and provenance.is_late(".work/hashes.lock")
    assert verify.verify_dir(rd) == []


def test_a_file_changed_in_place_with_the_same_size_is_hashed_again(run):
    rd, ov = run
    samples = rd / "data" / "samples.jsonl"
    _flip_in_place(samples)
    _stage("manifest", ov)
    man = _record(rd, "manifest")
    assert man["hashed_files"].get("data/samples.jsonl") == samples.stat().st_size, man["hashed_files"]
    listed = json.loads((rd / "provenance" / "files.sha256.json").read_text())["files"]
    assert listed["data/samples.jsonl"]["sha256"] == sha256_bytes(samples.read_bytes())
    # and the same through the API, for an mtime that moved while nothing else did
    hashes.use_run(rd)
    hashes.reset_counters()
    assert sha256_file(samples) == listed["data/samples.jsonl"]["sha256"] and hashes.bytes_hashed() == 0
    st = samples.stat()
    os.utime(samples, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert sha256_file(samples) == listed["data/samples.jsonl"]["sha256"] and hashes.bytes_hashed() == st.st_size


def test_a_tampered_file_with_a_forged_mtime_is_caught(run):
    rd, _ = run
    counts = rd / "data" / "counts.json"
    hashes.use_run(rd)
    was = sha256_file(counts)
    before = _flip_in_place(counts)
    os.utime(counts, ns=(before.st_atime_ns, before.st_mtime_ns))  # size and mtime as they were
    assert counts.stat().st_mtime_ns == before.st_mtime_ns
    # the memo does not take it (the forged mtime moved ctime) ...
    hashes.reset_counters()
    assert sha256_file(counts) != was and hashes.bytes_hashed() == before.st_size
    # ... and verify reads every byte anyway, even with every digest remembered
    hashes.reset_counters()
    problems = verify.verify_dir(rd)
    listed = json.loads((rd / "provenance" / "files.sha256.json").read_text())["files"]
    assert hashes.bytes_hashed() >= sum(e["bytes"] for e in listed.values())
    assert any(p.startswith("data/counts.json: changed") for p in problems), problems
    out = subprocess.run([sys.executable, "-m", "pipeline", "verify", str(rd)], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 1 and "verify: data/counts.json: changed" in out.stdout, out.stdout[-2000:]


def test_a_written_file_is_never_read_back_and_a_rewrite_is(tmp_path):
    """atomic writers record what they hashed while writing; a new file at the same path is read."""
    p = tmp_path / "a.bin"
    atomic_write_bytes(p, b"x" * 1000)
    hashes.reset_counters()
    assert sha256_file(p) == sha256_bytes(b"x" * 1000) and hashes.counters()["bytes_hashed"] == 0
    p.write_bytes(b"y" * 1000)  # same size, in place
    assert sha256_file(p) == sha256_bytes(b"y" * 1000) and hashes.bytes_hashed() == 1000
    assert sha256_file(p, reuse=False) == sha256_bytes(b"y" * 1000) and hashes.bytes_hashed() == 2000


def test_a_file_moved_by_hashes_move_keeps_its_digest_and_a_plain_rename_is_read_again(tmp_path):
    """A rename moves the file's ctime, which the memo checks: `hashes.move` (the quantize-drafter's move
    of its bf16 reference into place) carries the digest over; a plain os.replace costs one read."""
    import os

    a, b, c = tmp_path / "a.bin", tmp_path / "sub" / "b.bin", tmp_path / "c.bin"
    b.parent.mkdir()
    atomic_write_bytes(a, b"z" * 4096)
    hashes.reset_counters()
    hashes.move(a, b)
    assert not a.exists() and sha256_file(b) == sha256_bytes(b"z" * 4096) and hashes.bytes_hashed() == 0
    os.replace(b, c)
    assert sha256_file(c) == sha256_bytes(b"z" * 4096) and hashes.bytes_hashed() == 4096


_WORKER = """
import sys
from pathlib import Path
from pipeline.core import hashes
run, tag, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
hashes.use_run(run)
for i in range(n):
    f = run / f"{tag}-{i}.bin"
    f.write_bytes(f"{tag} {i}".encode())
    hashes.sha256_file(f)
    hashes.flush()
"""


def test_processes_flushing_at_once_lose_no_digest(tmp_path):
    """Two processes (as torchrun ranks, or two stages of one run) merge into one store under its lock."""
    run = tmp_path / "run"
    run.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(run), tag, "25"], cwd=REPO) for tag in "ab"]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    doc = json.loads((run / hashes.STORE).read_text())
    assert doc["schema"] == hashes.SCHEMA
    paths = {Path(e["path"]).name: e["sha256"] for e in doc["entries"].values()}
    assert paths == {f"{t}-{i}.bin": sha256_bytes(f"{t} {i}".encode()) for t in "ab" for i in range(25)}
    assert not [p for p in (run / ".work").iterdir() if p.name not in ("hashes.json", "hashes.lock")]


_READER = """
import sys
from pipeline.core import hashes
hashes.use_run(sys.argv[1])
hashes.reset_counters()
digests = [hashes.sha256_file(p) for p in sys.argv[2:]]
print(hashes.bytes_hashed(), *digests)
"""


def test_files_written_in_a_folder_swapped_in_keep_their_digests_for_the_next_process(tmp_path):
    """A folder `atomic_dir` renames into place (every checkpoint, quantize-drafter's bf16 reference) keeps its
    files' digests in the run's store: the next stage, another process, reads none of their bytes."""
    from pipeline.core.io import atomic_dir

    run = tmp_path / "run"
    hashes.use_run(run)
    with atomic_dir(run / "drafter" / "bf16") as tmp:
        atomic_write_bytes(tmp / "config.json", b"{}\n")  # hashed while written
        scratch = run / ".work" / "fresh.bin"
        atomic_write_bytes(scratch, b"w" * 5000)
        hashes.move(scratch, tmp / "model.safetensors")  # written elsewhere in the run, moved in
    assert hashes.flush() is not None
    files = [run / "drafter" / "bf16" / n for n in ("config.json", "model.safetensors")]
    out = subprocess.run([sys.executable, "-c", _READER, str(run), *map(str, files)], cwd=REPO, env=ENV,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0", sha256_bytes(b"{}\n"), sha256_bytes(b"w" * 5000)]
