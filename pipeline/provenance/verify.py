"""Re-hash every file of a run directory or a published folder against the records (`verify_dir`); the command
`python -m pipeline verify <run dir or published dir>` is `pipeline.commands.verify`.

Every byte is read again: the digests `pipeline.core.hashes` remembers are never used here.

What is checked (each problem names the file):
- `provenance/files.sha256.json` (the folder's own list; rule in pipeline/provenance/record.py, format
  pipeline/artifacts/file_list.py) is intact:
  valid JSON, canonical bytes, and its `files_sha256` matches its content;
- every listed file exists with that sha256 and size (missing / changed), and no unlisted file
  exists (extra; temp files left by an interrupted write and symbolic links count as extra). In a run directory,
  `stages/manifest.json`, `stages/publish*.json` and `publish/` are written after the manifest, so
  they are not listed, nor is the scratch `.work/` (the hash memo); each `publish/<variant>/` holding a
  file list is verified in turn;
- the in-toto statement's subjects, the calibration manifest's cache shards and the quant run
  manifest's checkpoint files (both read through pipeline/artifacts/manifests.py) agree with the files (a record that disagrees while the file matches
  the list is reported as that record being altered); in a published folder, each file's "origin"
  digest in the run's statement equals the file's;
- in a published folder, its OpenSSF model signing signature `model.sig` (pipeline/provenance/signing.py), when a
  public key is given (`--public-key PATH`, or `publish.public_key` in conf/): model_signing's verifier
  checks the signature, then every file against it; a file the signature disagrees with is named once
  (on its hash-check line when that already names it). With a key but no `model.sig` the folder is
  refused; without a key the signature is reported as present but not checked. A signature made with an
  X.509 certificate is checked against trusted root certificates instead (`--root-certs PATH...`, or
  `publish.root_certs`); the OK line names the certificate that signed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.artifacts import file_list, manifests
from pipeline.core.errors import SpecquantError
from pipeline.core.io import in_hf_local_cache
from pipeline.provenance import record as prov
from pipeline.provenance import signing


def _load(path: Path, rel: str, problems: list[str]) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        problems.append(f"{rel}: not valid JSON ({exc}); it was altered or truncated")
        return None


def _check_list(folder: Path, problems: list[str]) -> file_list.FileList | None:
    path = folder / prov.FILE_LIST
    if not path.is_file():
        problems.append(f"{prov.FILE_LIST}: missing; run `python -m pipeline manifest` (run dir) or "
                        "`pipeline.provenance.record.write_file_list` (published folder) first")
        return None
    doc = _load(path, prov.FILE_LIST, problems)
    if doc is None:
        return None
    listing, found = file_list.check(doc, path.read_bytes())
    problems += [f"{prov.FILE_LIST}: {p}" for p in found]
    return listing


def _manifest(folder: Path, rel: str, parse, problems: list[str]):
    """A manifest through its reader (`pipeline.artifacts.manifests`), or None (absent, or named in `problems`)."""
    doc = _load(folder / rel, rel, problems)
    if doc is None:
        return None
    try:
        return parse(doc, rel)
    except SpecquantError as exc:
        problems.append(f"{rel}: {exc}")
        return None


def _claims(folder: Path, listing: file_list.FileList, problems: list[str]) -> dict[str, dict[str, str]]:
    """{file: {record file: sha256 it claims}} from the statement and, in a run dir, the manifests."""
    claims: dict[str, dict[str, str]] = {}

    def add(rel: str, source: str, digest: str | None) -> None:
        if digest:
            claims.setdefault(rel, {})[source] = digest

    att = _load(folder / prov.ATTESTATION, prov.ATTESTATION, problems) if (folder / prov.ATTESTATION).is_file() else None
    raw = (att or {}).get("subject", []) if isinstance(att, dict) else []
    raw = raw if isinstance(raw, list) else []
    subjects = {s["name"]: (s.get("digest") if isinstance(s.get("digest"), dict) else {}).get("sha256")
                for s in raw if isinstance(s, dict) and isinstance(s.get("name"), str)}
    if len(subjects) != len(raw):
        problems.append(f"{prov.ATTESTATION}: {len(raw) - len(subjects)} subject(s) without a file name; "
                        "the statement was altered")
    if listing.kind == "published":
        for rel, e in listing.files.items():
            if e.origin and subjects:
                if e.origin not in subjects:
                    problems.append(f"{rel}: its origin {e.origin} is not a subject of {prov.ATTESTATION}")
                add(rel, f"{prov.ATTESTATION} (as {e.origin})", subjects.get(e.origin))
        return claims
    for rel, d in subjects.items():
        add(rel, prov.ATTESTATION, d)
    if att is not None:
        expected = set(listing.files) - {prov.ATTESTATION}
        for rel in sorted(expected - set(subjects)):
            problems.append(f"{prov.ATTESTATION}: has no subject for {rel}; the statement was altered or is stale")
        for rel in sorted(set(subjects) - expected - set(listing.files)):
            problems.append(f"{prov.ATTESTATION}: names {rel}, which {prov.FILE_LIST} does not list")
    calib = _manifest(folder, manifests.CALIBRATION, manifests.parse_calibration, problems)
    for s in (calib.cache.shards if calib and calib.cache else []):
        add(s.file, manifests.CALIBRATION, s.sha256)
    quant = _manifest(folder, manifests.QUANT_RUN, manifests.parse_quant_run, problems)
    for ck in (quant.checkpoints if quant else []):
        for name, e in ck.files.items():
            add(f"{ck.path}/{name}", manifests.QUANT_RUN, e.sha256)
    return claims


def _fold_signature(folder: Path, public_key, problems: list[str]) -> None:
    """Add the signature's problem: a file it disagrees with that a hash check already named gets a clause
    on that line; the others are named in one `model.sig: ...` sentence."""
    res = signing.check(folder, public_key)
    if res.problem is None:
        return
    rest = []
    for rel in res.altered or []:
        i = next((i for i, p in enumerate(problems) if p.startswith(f"{rel}: ")), None)
        if i is None:
            rest.append(rel)
        else:
            problems[i] += f"; the signature in {signing.SIGNATURE} no longer matches it either"
    if res.altered is None or rest:
        problem = res.problem
        if res.altered and len(rest) < len(res.altered):  # name only what no other line names
            problem = signing.altered_sentence(rest, res.signed, res.present)
        problems.append(problem)


def verify_dir(path: str | Path, public_key: str | Path | bytes | None = None, reuse: bool = False) -> list[str]:
    """Every problem found in a run directory or a published folder, each naming the file; [] = verified.

    `public_key` (a path, or PEM bytes): also check a published folder's `model.sig` with it.
    Every byte is read again (`reuse=False`, what `python -m pipeline verify` does); `reuse=True` takes
    the digest `pipeline.core.hashes` remembers for a file whose size, mtime and ctime are unchanged since it
    was hashed (publish's check of the run it is about to publish)."""
    folder = Path(path)
    if not folder.is_dir():
        return [f"{folder}: not a directory"]
    problems: list[str] = []
    listing = _check_list(folder, problems)
    if listing is None:
        return problems
    listed = listing.files
    if listing.kind == "run":
        def skip(rel):
            return rel == prov.FILE_LIST or prov.is_late(rel)
    else:
        def skip(rel):
            # a published folder fetched with `hf download --local-dir` holds the client's own metadata;
            # the signature signs the folder, so no list inside it can name it
            return rel in (prov.FILE_LIST, signing.SIGNATURE) or in_hf_local_cache(rel)
    present = prov.list_files(folder, skip)
    temps = [p.relative_to(folder).as_posix() for p in folder.rglob(prov.TMP_PREFIX + "*")
             if not (listing.kind == "run" and prov.is_late(p.relative_to(folder).as_posix()))]
    links = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_symlink()
             and not (listing.kind == "run" and prov.is_late(p.relative_to(folder).as_posix()))]
    actual = prov.hash_files(folder, present, desc=f"verifying {folder.name}", reuse=reuse)
    for rel in sorted(set(listed) - set(actual)):
        problems.append(f"{rel}: missing (listed in {prov.FILE_LIST})")
    for rel in sorted(set(actual) - set(listed)):
        problems.append(f"{rel}: extra file, not listed in {prov.FILE_LIST}")
    for rel in sorted(temps):
        problems.append(f"{rel}: extra temporary file left by an interrupted write")
    for rel in sorted(links):
        problems.append(f"{rel}: extra symbolic link (only regular files are recorded; links are never followed)")
    for rel, e in sorted(listed.items()):
        if rel in actual and (actual[rel]["sha256"] != e.sha256 or actual[rel]["bytes"] != e.bytes):
            problems.append(f"{rel}: changed (sha256 {actual[rel]['sha256'][:16]}..., {actual[rel]['bytes']} bytes; "
                            f"{prov.FILE_LIST} records {e.sha256[:16]}..., {e.bytes} bytes)")
    for rel, sources in sorted(_claims(folder, listing, problems).items()):
        for source, digest in sorted(sources.items()):
            if rel not in actual:
                if rel not in listed:
                    problems.append(f"{rel}: missing (recorded in {source})")
            elif rel in listed and actual[rel]["sha256"] != digest and actual[rel]["sha256"] == listed[rel].sha256:
                problems.append(f"{source.split(' ')[0]}: records sha256 {digest[:16]}... for {rel}, but the file "
                                f"(and {prov.FILE_LIST}) has {actual[rel]['sha256'][:16]}...; the record was altered or is stale")
    if listing.kind == "published" and public_key is not None:
        _fold_signature(folder, public_key, problems)
    if listing.kind == "run":
        for sub in sorted((folder / "publish").glob("*/" + prov.FILE_LIST)):
            pub = sub.parent.parent
            problems += [f"publish/{pub.name}/{p}" for p in verify_dir(pub, public_key, reuse)]
    return problems


def signature_notes(path: str | Path) -> list[str]:
    """One line per published folder (the folder itself, or a run's publish/<variant>/) whose signature
    is not checked: unsigned, or signed but no public key given."""
    folder = Path(path)
    pubs = [folder] if not (folder / "publish").is_dir() else \
        [p.parent.parent for p in sorted((folder / "publish").glob("*/" + prov.FILE_LIST))]
    out = []
    for pub in pubs:
        note = signing.check(pub, None).note
        if note and (pub / prov.FILE_LIST).is_file():
            # `publish/<v>/model.sig: ...`, or `publish/<v>: unsigned: ...` (no file to name)
            out.append(note if pub == folder else f"publish/{pub.name}/{note}" if note.startswith(signing.SIGNATURE)
                       else f"publish/{pub.name}: {note}")
    return out
