"""The shared IO pieces every stage relies on: atomic writes, hashing, path confinement."""

from __future__ import annotations

import hashlib
import os
import stat

import pytest

from pipeline.core.errors import SpecquantError
from pipeline.core.io import (
    PARTIAL_PREFIX,
    TMP_PREFIX,
    HashingWriter,
    atomic_dir,
    atomic_open,
    atomic_write_json,
    confine,
    hash_files,
    hash_tree,
    in_hf_local_cache,
    list_files,
    remove_stale_temps,
)


def test_atomic_write_leaves_nothing_on_failure_and_keeps_old_content(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_open(target) as fh:
        fh.write(b"half-written")
        raise RuntimeError("killed mid-write")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_atomic_files_get_normal_permissions_and_canonical_json(tmp_path):
    atomic_write_json(tmp_path / "a.json", {"b": 1, "a": [1, 2]})
    assert (tmp_path / "a.json").read_text() == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n'
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o666 & ~umask


def test_hashing_writer_equals_a_second_read(tmp_path):
    with open(tmp_path / "x", "wb") as raw:
        w = HashingWriter(raw)
        w.write(b"abc" * 1000)
        w.write(b"def")
    assert w.hexdigest() == hashlib.sha256((tmp_path / "x").read_bytes()).hexdigest() and w.bytes == 3003
    assert hash_tree(tmp_path) == {"x": {"sha256": w.hexdigest(), "bytes": 3003}}


def test_confine_resolves_relative_paths_from_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "tiny").mkdir(parents=True)
    assert confine("runs/tiny/cache", "runs/tiny", "cache dir") == tmp_path / "runs" / "tiny" / "cache"
    (tmp_path / "runs" / "tiny" / "escape").symlink_to("/etc")
    with pytest.raises(SpecquantError, match="outside the run directory"):
        confine("runs/tiny/escape", "runs/tiny", "escape")


def test_stale_temps_are_removed(tmp_path):
    (tmp_path / f"{TMP_PREFIX}abc").write_bytes(b"x")
    (tmp_path / "keep").write_bytes(b"y")
    assert remove_stale_temps(tmp_path) == 1 and [p.name for p in tmp_path.iterdir()] == ["keep"]


def test_hash_tree_follows_the_file_list_rule(tmp_path):
    """hash_tree = hash_files(list_files(...)): regular files only, no temp files, no symlinks; `exclude` skips."""
    from pipeline.provenance import record as provenance

    (tmp_path / "d").mkdir()
    (tmp_path / "a").write_bytes(b"a")
    (tmp_path / "d" / "b").write_bytes(b"bb")
    (tmp_path / "d" / f"{TMP_PREFIX}x").write_bytes(b"half")
    (tmp_path / "link").symlink_to(tmp_path / "a")
    tree = hash_tree(tmp_path)
    assert tree == hash_files(tmp_path, list_files(tmp_path)) == {
        "a": {"sha256": hashlib.sha256(b"a").hexdigest(), "bytes": 1},
        "d/b": {"sha256": hashlib.sha256(b"bb").hexdigest(), "bytes": 2}}
    assert list(hash_tree(tmp_path, exclude=("d",))) == ["a"]
    assert list_files(tmp_path, follow_links=True) == ["a", "d/b", "link"]
    assert provenance.list_files is list_files and provenance.hash_files is hash_files  # one implementation


def test_hf_local_cache_rule():
    assert in_hf_local_cache(".cache/huggingface/download/model.safetensors.metadata")
    assert in_hf_local_cache(".cache/huggingface")
    assert not in_hf_local_cache(".cache/other/x") and not in_hf_local_cache("sub/.cache/huggingface/x")
    assert not in_hf_local_cache("model.safetensors")


def test_atomic_dir_swaps_whole_directories(tmp_path):

    final = tmp_path / "ckpt"
    with atomic_dir(final) as d:
        (d / "a").write_bytes(b"1")
        assert not final.exists()  # invisible until complete
    assert [p.name for p in final.iterdir()] == ["a"]
    with pytest.raises(RuntimeError), atomic_dir(final) as d:
        (d / "b").write_bytes(b"2")
        raise RuntimeError("killed mid-write")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"] and (final / "a").read_bytes() == b"1"
    (tmp_path / f"{PARTIAL_PREFIX}ckpt-99999").mkdir()  # what a SIGKILLed run leaves
    with atomic_dir(final) as d:
        (d / "c").write_bytes(b"3")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"] and [p.name for p in final.iterdir()] == ["c"]
