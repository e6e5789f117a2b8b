"""The X.509 side of model signing: trusted roots, a signing certificate's facts, certificate files read
in one sentence, and the certificate a signature bundle carries.

Split from `pipeline.provenance.signing` (issue 46), which signs and checks with these: nothing here
signs, verifies or reads a private key, so `python -m pipeline verify` (`pipeline.commands.verify`)
reads root certificates and shows a bundle's certificate through this module alone. model_signing
checks a chain at the signing certificate's start of validity (the bundle carries no trusted time, and
no revocation is checked), so `expiry_note` says when a certificate has expired since.
"""

from __future__ import annotations

import base64
import datetime as _dt
import json
import os
from dataclasses import dataclass
from pathlib import Path

from pipeline.core.errors import bad_value


@dataclass(frozen=True)
class Roots:
    """Trusted root CA certificates (PEM files) that a certificate signature must chain to."""

    paths: tuple[Path, ...]
    shown: str  # how a sentence names them: the paths as given, or "the publisher's root certificates"


@dataclass(frozen=True)
class Certificate:
    """A configured signing certificate and its chain (paths, and what the card and record show)."""

    path: Path
    chain: tuple[Path, ...]
    subject: str
    issuer: str
    sha256: str  # of the certificate's DER, the usual certificate fingerprint
    not_after: str
    roots: Roots  # what publish checks its own signature against

    def info(self) -> dict[str, str]:
        return {"subject": self.subject, "issuer": self.issuer, "sha256": self.sha256, "not_after": self.not_after}


def _cert_name(name) -> str:
    return name.rfc4514_string() or "(empty name)"


def describe(cert) -> dict[str, str]:
    """Subject, issuer, sha256 fingerprint and end of validity of an x509 certificate."""
    from cryptography.hazmat.primitives import hashes

    return {"subject": _cert_name(cert.subject), "issuer": _cert_name(cert.issuer),
            "sha256": cert.fingerprint(hashes.SHA256()).hex(), "not_after": cert.not_valid_after_utc.isoformat()}


def load_certificates(field: str, path: str | os.PathLike, what: str) -> list:
    """The PEM certificates in a file (one sentence if it cannot be read or holds none)."""
    from cryptography import x509

    p = Path(str(path)).expanduser()
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise bad_value(field, str(path), f"the certificate file cannot be read ({exc.strerror or exc})",
                        f"give the path of {what} (PEM)") from None
    if b"PRIVATE KEY" in data:
        raise bad_value(field, str(path), "it holds a private key, and only certificates belong here",
                        f"give a file holding only {what} (PEM)")
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError:
        certs = []
    if not certs:
        raise bad_value(field, str(path), "it holds no PEM certificate (`-----BEGIN CERTIFICATE-----`)",
                        f"give {what} (PEM)")
    return certs


def load_roots(field: str, paths, shown: str | None = None) -> Roots:
    """Trusted root certificate files, each checked to hold PEM certificates."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths or [])
    if not paths:
        raise bad_value(field, [], "no root certificate is given", "give the issuing CA's root certificate (PEM)")
    for p in paths:
        load_certificates(field, p, "the issuing CA's root certificate")
    return Roots(tuple(Path(str(p)).expanduser() for p in paths), shown or ", ".join(str(p) for p in paths))


def self_signed(cert) -> bool:
    """Whether a certificate is a root: issued by itself and signed by its own key. publish takes the chain's
    roots as what it checks its own signature against when publish.root_certs is unset."""
    if cert.subject != cert.issuer:
        return False
    try:
        cert.verify_directly_issued_by(cert)
        return True
    except Exception:  # noqa: BLE001 - not self-signed (a signature or key-type mismatch)
        return False


def bundle_certificate(sig: Path) -> dict[str, str] | None:
    """The signing certificate inside a bundle (subject, issuer, sha256, not_after), or None: signed with a
    bare key, or unreadable (model_signing's verifier then says so)."""
    from cryptography import x509

    try:
        chain = json.loads(sig.read_text(encoding="utf-8"))["verificationMaterial"]["x509CertificateChain"]
        return describe(x509.load_der_x509_certificate(base64.b64decode(chain["certificates"][0]["rawBytes"])))
    except Exception:  # noqa: BLE001 - no certificate, or a bundle too broken to show one
        return None


def bundle_is_certificate(sig: Path) -> bool:
    """Whether a bundle was signed with a certificate (not a bare key): which trust it needs decides the
    sentence when the wrong one is given. An unreadable bundle counts as not, and the verifier says why."""
    try:
        return "x509CertificateChain" in json.loads(sig.read_text(encoding="utf-8"))["verificationMaterial"]
    except Exception:  # noqa: BLE001 - unreadable: the verifier reports it
        return False


def expiry_note(cert: dict[str, str] | None) -> str | None:
    """One clause when a verified certificate signature's certificate has expired since (see the module
    docstring)."""
    if not cert:
        return None
    end = _dt.datetime.fromisoformat(cert["not_after"])
    if end >= _dt.datetime.now(_dt.UTC):
        return None
    return (f"its certificate {cert['subject']} expired on {end:%Y-%m-%d}; model signing checks the chain at the "
            "certificate's start of validity, as the bundle carries no trusted time")
