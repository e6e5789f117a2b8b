"""`python -m pipeline verify <run dir or published dir>`: re-hash every file against the records.

What is checked: `pipeline.provenance.verify` (`verify_dir`). This module reads the command line, the trusted
key or root certificates (the flags, else `publish.public_key` / `publish.root_certs` in conf/), and prints.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipeline.artifacts import file_list
from pipeline.core.errors import SpecquantError, bad_value
from pipeline.core.secrets import scrub
from pipeline.provenance import certificates, signing
from pipeline.provenance import record as prov
from pipeline.provenance.verify import signature_notes, verify_dir


def _configured(key: str):
    """`publish.<key>` from conf/ (the default composition), or None."""
    try:
        from pipeline.core.config import compose

        value = compose([]).publish.get(key)
    except Exception:  # noqa: BLE001 - no usable conf/ (e.g. outside a checkout): nothing configured
        return None
    return value or None


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline verify",
                                 description="Re-hash every file of a run directory or a published folder "
                                             "against its file list, manifests and in-toto statement.")
    ap.add_argument("path", nargs="?", default="runs/tiny", help="run directory or published repo folder")
    ap.add_argument("--json", action="store_true", help="print the problems as a JSON list")
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--public-key", metavar="PATH", default=None,
                       help="the publisher's elliptic-curve public key (PEM): check the folder's signature model.sig "
                            "with it (default: publish.public_key in conf/; none = the signature is not checked)")
    how.add_argument("--root-certs", metavar="PATH", nargs="+", default=None,
                       help="trusted root CA certificates (PEM): check a model.sig signed with a certificate against "
                            "them (default: publish.root_certs in conf/)")
    args = ap.parse_args(argv)
    if not Path(args.path).is_dir():
        raise bad_value("path", args.path, "no such directory",
                        "give a run directory (runs/<name>) or a published folder (runs/<name>/publish/<variant>)")
    field = "--public-key"
    key, roots = args.public_key, args.root_certs
    if key is None and roots is None and any((p / signing.SIGNATURE).is_file() for p in
                                             [Path(args.path), *Path(args.path).glob("publish/*")]):
        key, field = _configured("public_key"), "publish.public_key"
        if key is None and _configured("root_certs"):
            roots, field = list(_configured("root_certs")), "publish.root_certs"
    trust = None  # a public key path, or certificates.Roots
    try:
        if roots is not None:
            trust = certificates.load_roots("--root-certs" if field == "--public-key" else field, roots)
        elif key is not None:
            signing.load_public_key(field, key)  # one sentence now for a bad key file
            trust = key
    except SpecquantError as exc:
        raise SpecquantError(scrub(str(exc))) from None
    problems = [scrub(p) for p in verify_dir(args.path, public_key=trust)]
    if args.json:
        print(json.dumps(problems, indent=2))
    elif problems:
        for p in problems:
            print(f"verify: {p}")
        print(f"verify: FAILED, {len(problems)} problem(s) in {args.path}")
    else:
        listing = file_list.read(Path(args.path) / prov.FILE_LIST)
        root = Path(args.path)
        sigs = [p.relative_to(root).as_posix() for p in [root / signing.SIGNATURE,
                                                         *sorted(root.glob(f"publish/*/{signing.SIGNATURE}"))]
                if p.is_file()] if trust is not None else []
        signed = f" and {' and '.join(sigs)} verif{'ies' if len(sigs) == 1 else 'y'} with " \
                 f"{trust.shown if roots is not None else key}" if sigs else ""
        if sigs and roots is not None:  # who signed: any certificate the roots issued would verify
            certs = [certificates.bundle_certificate(root / s) or {} for s in sigs]
            signed += "".join(f" (signed by {c.get('subject')}, certificate sha256 {str(c.get('sha256'))[:16]}..."
                              + (f"; {n}" if (n := certificates.expiry_note(c)) else "") + ")" for c in certs)
        print(f"verify: OK, {len(listing.files)} files in {args.path} match their recorded sha256{signed}")
        if trust is None:
            for note in signature_notes(args.path):
                print(f"verify: {note}")
    return 1 if problems else 0
