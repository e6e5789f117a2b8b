"""Signing a published folder with OpenSSF model signing (OMS, the `model-signing` package), offline.

`publish` signs each assembled `publish/<variant>/` folder with an elliptic-curve private key
(PEM; P-256, P-384 or P-521) named by `publish.signing_key` (a path) or `publish.signing_key_env`
(a variable holding a path): as a bare key, or, with `publish.signing_certificate` (the key's X.509
certificate, PEM) and `publish.certificate_chain` (the certificates that issued it), as that certificate,
which then travels inside the bundle with its chain. The signature, `model.sig`, is an OMS Sigstore bundle: a DSSE envelope
around an in-toto statement listing the sha256 of every file in the folder (weights, card, manifests,
`provenance/` with the run's in-toto statement and the file list), signed offline (no transparency log).
It is the one file the signature does not cover, and the Hub client's `.cache/huggingface/` metadata
(written by `hf download --local-dir`) is left out like in `pipeline.provenance.verify`.

The key is read from its path by model_signing and never copied: only its path (in the stage
record's resolved config) and its public key's sha256 (the OMS key hint, in the card and the publish
record) are written anywhere; `pipeline.core.secrets` scrubs a PEM private key block from any text.

`python -m pipeline verify` checks the signature with a public key (`--public-key PATH` or
`publish.public_key`) or, for a certificate signature, against trusted root certificates (`--root-certs
PATH...` or `publish.root_certs`) through model_signing's own verifier, then names what fails in one
sentence. model_signing checks the certificate chain at the signing certificate's start of validity (the
bundle carries no trusted time, and no revocation is checked), so a certificate that has expired since
still verifies; publish refuses to sign with one that is expired or not yet valid, and verify says when
the certificate has expired since. The X.509 side (roots, certificate files, the certificate a bundle
carries, `expiry_note`) is `pipeline.provenance.certificates`.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as _dt
import hashlib
import io
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pipeline.core.errors import bad_value
from pipeline.core.io import HF_LOCAL_DIR_CACHE, TMP_PREFIX, sha256_file
from pipeline.core.secrets import remember
from pipeline.provenance.certificates import (
    Certificate,
    Roots,
    bundle_certificate,
    bundle_is_certificate,
    describe,
    load_certificates,
    load_roots,
    self_signed,
)

SIGNATURE = "model.sig"
# not covered by the signature: the signature itself and the Hub client's local-dir metadata
IGNORED = (SIGNATURE, HF_LOCAL_DIR_CACHE.rstrip("/"))
CURVES = ("secp256r1", "secp384r1", "secp521r1")  # what model_signing's key signer accepts


def tool_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("model-signing")
    except PackageNotFoundError:
        return "not installed"


def key_fingerprint(public_pem: bytes) -> str:
    """sha256 of the public key's PEM (SubjectPublicKeyInfo): the key hint OMS writes into the bundle."""
    return hashlib.sha256(public_pem).hexdigest()


def _public_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


@dataclass(frozen=True)
class Signer:
    """A configured signing key: its path (never its content), its public half, and its certificate if any."""

    key_path: Path
    field: str
    password_env: str | None
    public_pem: bytes
    certificate: Certificate | None = None

    @property
    def fingerprint(self) -> str:
        return key_fingerprint(self.public_pem)

    @property
    def trust(self) -> bytes | Roots:
        """What this signer's signature verifies with: its public key, or its certificate's roots."""
        return self.certificate.roots if self.certificate else self.public_pem

    def password(self) -> bytes | None:
        value = os.environ.get(self.password_env) if self.password_env else None
        remember(value)
        return value.encode() if value else None


def signer_from_config(cfg) -> Signer | None:
    """The configured signing key, checked before any work (one sentence per problem), or None: unsigned."""
    pc = cfg.publish
    if pc.signing_key:
        raw, field = str(pc.signing_key), "publish.signing_key"
    elif pc.signing_key_env:
        raw, field = os.environ.get(str(pc.signing_key_env)) or "", "publish.signing_key_env"
        if not raw.strip():
            raise bad_value(field, pc.signing_key_env, "the variable is unset or empty, so there is no signing key",
                            f"export {pc.signing_key_env}=<path to an elliptic-curve private key (PEM)>, or set "
                            "publish.signing_key_env=null to publish unsigned")
    else:
        return None
    if "PRIVATE KEY" in raw:  # the key itself instead of its path: never echo it
        remember(raw)
        raise bad_value(field, "<a PEM private key>", "it holds the key itself, not the path of the key file",
                        "put the key in a file readable only by you and give its path")
    path = Path(raw).expanduser()
    shown = pc.signing_key_env if field.endswith("_env") else raw
    where = f" ({pc.signing_key_env}={raw})" if field.endswith("_env") else ""
    if not path.is_file():
        raise bad_value(field, shown, f"no signing key file at {path}{where}",
                        "give the path of an elliptic-curve private key (PEM), or leave signing unset to publish unsigned")
    pw_env = str(pc.signing_key_password_env) if pc.signing_key_password_env else None
    signer = Signer(path, field, pw_env, b"")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    try:
        key = serialization.load_pem_private_key(path.read_bytes(), signer.password())
    except OSError as exc:
        raise bad_value(field, shown, f"the key file {path} cannot be read ({exc.strerror or exc})",
                        "fix its permissions for the user running publish") from None
    except TypeError:  # encrypted without a password, or a password for an unencrypted key
        raise bad_value("publish.signing_key_password_env", pc.signing_key_password_env,
                        f"the key {path} is encrypted and no password was given, or it is not encrypted and one was",
                        "set publish.signing_key_password_env to a variable holding its password (or unset it)") from None
    except (ValueError, Exception) as exc:  # noqa: B014 - cryptography raises several types for a bad file
        why = "the password is wrong or " if pw_env else ""
        raise bad_value(field, shown, f"{why}{path} is not a PEM private key ({type(exc).__name__})",
                        "give an elliptic-curve private key in PEM, e.g. from "
                        "`openssl ecparam -name prime256v1 -genkey -noout -out key.pem`") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name not in CURVES:
        what = f"an elliptic-curve key on {key.curve.name}" if isinstance(key, ec.EllipticCurvePrivateKey) else \
            f"a {type(key).__name__.removeprefix('_').replace('PrivateKey', '')} key"
        raise bad_value(field, shown, f"{path} is {what}, and model signing takes elliptic-curve keys on "
                        "P-256, P-384 or P-521 only", "generate one with "
                        "`openssl ecparam -name prime256v1 -genkey -noout -out key.pem`")
    signer = Signer(path, field, pw_env, _public_pem(key.public_key()))
    if pc.get("signing_certificate"):
        if pw_env:
            raise bad_value("publish.signing_key_password_env", pw_env, "model signing's certificate signer "
                            "cannot read an encrypted private key", "sign with a certificate using an unencrypted "
                            "key file readable only by you, or drop publish.signing_certificate to sign with the bare key")
        return Signer(path, field, None, signer.public_pem, certificate_from_config(pc, key, path))
    if pc.public_key:
        pub = load_public_key("publish.public_key", pc.public_key)
        if key_fingerprint(pub) != signer.fingerprint:
            raise bad_value("publish.public_key", pc.public_key, f"it is not the public half of the signing key "
                            f"{path} (public key sha256 {key_fingerprint(pub)[:16]}... vs {signer.fingerprint[:16]}...)",
                            "give the matching public key, or leave publish.public_key unset")
    return signer


def certificate_from_config(pc, key, key_path: Path) -> Certificate:
    """`publish.signing_certificate` and `publish.certificate_chain`, checked against the key, the time and
    model signing's rules before any work; then the chain is tried on a one-file folder through model_signing
    itself, so a chain publish could not verify is refused here, not after assembling."""
    from cryptography import x509

    field, raw = "publish.signing_certificate", str(pc.signing_certificate)
    cert = load_certificates(field, raw, "the signing key's X.509 certificate")[0]
    d = describe(cert)
    if _public_pem(cert.public_key()) != _public_pem(key.public_key()):
        raise bad_value(field, raw, f"the certificate {d['subject']} is not for the signing key (its public key "
                        f"sha256 is {key_fingerprint(_public_pem(cert.public_key()))[:16]}..., the key's "
                        f"{key_fingerprint(_public_pem(key.public_key()))[:16]}...)",
                        "give the certificate issued for that key, or the key it was issued for")
    now = _dt.datetime.now(_dt.UTC)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        when = (f"expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC" if now > cert.not_valid_after_utc else
                f"is not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC")
        raise bad_value(field, raw, f"the certificate {d['subject']} {when}", "sign with a certificate valid now")
    usable = False
    with contextlib.suppress(x509.ExtensionNotFound):
        usable = cert.extensions.get_extension_for_class(x509.KeyUsage).value.digital_signature
    with contextlib.suppress(x509.ExtensionNotFound):
        usable = usable or x509.oid.ExtendedKeyUsageOID.CODE_SIGNING in \
            cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    if not usable:
        raise bad_value(field, raw, f"the certificate {d['subject']} allows neither digital signatures (KeyUsage) "
                        "nor code signing (ExtendedKeyUsage), so model signing refuses it",
                        "ask the CA for a certificate with KeyUsage digitalSignature or ExtendedKeyUsage codeSigning")
    chain_paths = list(pc.get("certificate_chain") or [])
    if not chain_paths:
        raise bad_value("publish.certificate_chain", [], f"it is empty, and model signing's certificate signer "
                        f"needs the certificates that issued {d['subject']} (at least its issuer {d['issuer']})",
                        "list the intermediate and root certificate files (PEM), e.g. "
                        "publish.certificate_chain=[ca.pem]")
    for p in chain_paths:  # each file holds certificates (one sentence if not)
        load_certificates("publish.certificate_chain", p, "an issuing certificate")
    if pc.get("root_certs"):
        roots = load_roots("publish.root_certs", pc.root_certs)
    else:
        anchors = [str(Path(str(p)).expanduser()) for p in chain_paths
                   if any(self_signed(c) for c in load_certificates("publish.certificate_chain", p, "a certificate"))]
        if not anchors:
            raise bad_value("publish.root_certs", None, f"the certificate chain of {d['subject']} holds no root "
                            "(self-signed) certificate, so publish cannot check the signature it writes",
                            "set publish.root_certs=[<the root CA certificate (PEM)>] or add it to "
                            "publish.certificate_chain")
        roots = Roots(tuple(Path(a) for a in anchors), ", ".join(anchors))
    out = Certificate(Path(raw).expanduser(), tuple(Path(str(p)).expanduser() for p in chain_paths), d["subject"],
                      d["issuer"], d["sha256"], d["not_after"], roots)
    with tempfile.TemporaryDirectory(prefix=TMP_PREFIX) as tmp:  # removed at once; nothing of the key in it
        probe = Path(tmp) / "probe"
        probe.mkdir()
        (probe / "probe.txt").write_text("specquant certificate chain probe\n", encoding="utf-8")
        _sign(probe, Signer(key_path, field, None, b"", out), probe / SIGNATURE)
        res = check(probe, roots)
    if res.problem:
        raise bad_value(field, raw, f"model signing cannot verify a signature by it: {res.chain_error or res.problem}",
                        "give in publish.certificate_chain the certificates that issued it, and in "
                        "publish.root_certs (or the chain) its root")
    return out


def load_public_key(field: str, path: str | os.PathLike) -> bytes:
    """The PEM of an elliptic-curve public key file model signing can verify with (one sentence if not)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    p = Path(path).expanduser()
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise bad_value(field, str(path), f"the public key file cannot be read ({exc.strerror or exc})",
                        "give the path of the publisher's elliptic-curve public key (PEM)") from None
    if b"PRIVATE KEY" in data:
        raise bad_value(field, str(path), "it is a private key; verifying needs only the public key",
                        "export the public key (`openssl ec -in key.pem -pubout -out key.pub`) and give that")
    try:
        key = serialization.load_pem_public_key(data)
    except Exception as exc:  # noqa: BLE001 - ValueError or UnsupportedAlgorithm for a bad file
        raise bad_value(field, str(path), f"it is not a PEM public key ({type(exc).__name__})",
                        "give the publisher's elliptic-curve public key (PEM)") from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name not in CURVES:
        raise bad_value(field, str(path), "it is not an elliptic-curve key on P-256, P-384 or P-521",
                        "give the publisher's elliptic-curve public key (PEM)")
    return _public_pem(key)


@contextlib.contextmanager
def _public_key_file(public_key: str | os.PathLike | bytes, near: Path):
    """model_signing's verifier reads the public key from a path: the given one, or for PEM bytes (publish's
    own check) a temp file beside the folder, removed after."""
    if not isinstance(public_key, bytes):
        yield Path(public_key).expanduser()
        return
    with tempfile.TemporaryDirectory(prefix=TMP_PREFIX, dir=near) as d:
        p = Path(d) / "public.pem"
        p.write_bytes(public_key)
        yield p


def _hashing_config():
    from model_signing import hashing

    return hashing.Config().set_ignored_paths(paths=list(IGNORED), ignore_git_paths=True)


def _sign(folder: Path, signer: Signer, out: Path) -> None:
    """model_signing signs `folder` into `out` (the folder is hashed first, and model.sig is never hashed)."""
    from model_signing import signing

    config = signing.Config().set_hashing_config(_hashing_config())
    if signer.certificate:
        config.use_certificate_signer(private_key=signer.key_path, signing_certificate=signer.certificate.path,
                                      certificate_chain=list(signer.certificate.chain))
    else:
        config.use_elliptic_key_signer(private_key=signer.key_path, password=signer.password())
    config.sign(folder, out)


def sign_folder(folder: Path, signer: Signer, previous: bytes | None = None) -> str:
    """Write `folder/model.sig`. A previous signature by the same key over the same bytes is kept as it is
    (ECDSA signatures differ on every run, so re-signing would make every re-publish a new commit).
    Returns "kept" or "signed"."""
    sig = folder / SIGNATURE
    if previous is not None:
        sig.write_bytes(previous)
        same_cert = signer.certificate is None or (bundle_certificate(sig) or {}).get("sha256") == \
            signer.certificate.sha256  # a renewed certificate re-signs
        if same_cert and check(folder, signer.trust).problem is None:
            return "kept"
        sig.unlink()
    tmp = folder / f"{TMP_PREFIX}{SIGNATURE}"
    try:
        _sign(folder, signer, tmp)
        os.chmod(tmp, 0o644)  # like every other published file
        os.replace(tmp, sig)
    finally:
        tmp.unlink(missing_ok=True)
    return "signed"


@dataclass
class Result:
    problem: str | None = None  # one sentence, or None
    note: str | None = None  # one line when nothing is checked (unsigned, or no public key)
    altered: list[str] | None = None  # files the (authentic) signature disagrees with
    signed: dict[str, str] | None = None  # {file: sha256} the signature lists
    present: dict[str, str] | None = None  # {file: sha256} in the folder now
    certificate: dict[str, str] | None = None  # the signing certificate of a verified certificate signature
    chain_error: str | None = None  # why a certificate chain does not verify (publish's own check says it)


def _signed_resources(sig: Path) -> dict[str, str]:
    """{file: sha256} from the signed statement (read after model_signing authenticated it)."""
    bundle = json.loads(sig.read_text(encoding="utf-8"))
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    return {r["name"]: r["digest"] for r in statement["predicate"]["resources"]}


def _present(folder: Path) -> dict[str, str]:
    from pipeline.core.io import list_files

    def skip(rel: str) -> bool:
        return any(rel == i or rel.startswith(i + "/") for i in IGNORED) or rel.split("/")[0] in (
            ".git", ".github", ".gitattributes", ".gitignore")

    return {rel: sha256_file(folder / rel) for rel in list_files(folder, skip)}


def _names(files: list[str]) -> str:
    files = sorted(files)
    shown = files[:4] + ([f"{len(files) - 4} more"] if len(files) > 4 else [])
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " and " + shown[-1]


def _chain_error(exc: Exception) -> str:
    """OpenSSL's reason for a chain that does not verify, e.g. 'unable to get local issuer certificate'."""
    errors = getattr(exc, "errors", None)
    return str(errors[-1]) if errors else (str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


# what model_signing's verifier raises for a bundle it cannot read, a key or certificate it refuses, or (its
# "Signature mismatch") an authentic signature over other bytes than the folder's
_BUNDLE_ERRORS = (ValueError, KeyError, TypeError, AttributeError, IndexError, UnicodeDecodeError,
                  json.JSONDecodeError)


def check(folder: str | os.PathLike, public_key: str | os.PathLike | bytes | Roots | None) -> Result:
    """The signature of a published folder against a public key (a path or its PEM bytes) or, for a
    certificate signature, trusted root certificates (`Roots`)."""
    folder = Path(folder)
    sig = folder / SIGNATURE
    if public_key is None:
        return _unchecked(sig)
    roots = public_key if isinstance(public_key, Roots) else None
    shown = roots.shown if roots else "the publisher's public key" if isinstance(public_key, bytes) else str(public_key)
    if not sig.is_file():
        return Result(problem=f"{SIGNATURE}: missing; the folder is unsigned, so it cannot be verified "
                              f"with {shown}")
    cert = bundle_certificate(sig)
    wrong = _wrong_trust(sig, roots, shown, cert)
    if wrong is not None:
        return wrong
    pem = None if roots else public_key if isinstance(public_key, bytes) else load_public_key("--public-key", public_key)
    from cryptography.exceptions import InvalidSignature
    from model_signing import verifying
    from OpenSSL.crypto import X509StoreContextError

    with contextlib.ExitStack() as stack:
        config = verifying.Config()
        if roots:
            config.use_certificate_verifier(certificate_chain=list(roots.paths))
            signer = f"the certificate {cert['subject']} (sha256 {cert['sha256'][:16]}...)" if cert else \
                "its certificate"
        else:
            config.use_elliptic_key_verifier(public_key=stack.enter_context(_public_key_file(public_key, folder.parent)))
            signer = f"public key sha256 {key_fingerprint(pem)[:16]}..."
        try:
            # the verifier prints a warning for a bundle without a key hint; the sentence below says it all
            with contextlib.redirect_stdout(io.StringIO()):
                config.verify(folder, sig)
            return Result(certificate=cert)
        except (X509StoreContextError, InvalidSignature, *_BUNDLE_ERRORS) as exc:
            failed = _failure(exc, roots, shown, signer, cert)
            if failed is not None:
                return failed
            text = str(exc)
    return _altered(folder, sig, text)


def _unchecked(sig: Path) -> Result:
    """With no public key or roots nothing is verified: a note (not a problem) saying whether the folder is
    signed and what `verify` would need, so an unsigned or unchecked folder is never reported as verified."""
    if sig.is_file() and bundle_is_certificate(sig):
        return Result(note=f"{SIGNATURE}: certificate signature present but not checked (no root certificates: "
                           "pass --root-certs PATH or set publish.root_certs)")
    if sig.is_file():
        return Result(note=f"{SIGNATURE}: signature present but not checked (no public key: pass "
                           "--public-key PATH or set publish.public_key)")
    return Result(note=f"unsigned: no {SIGNATURE} (the hashes show the files agree with their records, "
                       "not who published them)")


def _wrong_trust(sig: Path, roots: Roots | None, shown: str, cert: dict[str, str] | None) -> Result | None:
    """A bare-key signature checked against root certificates, or a certificate signature against a public
    key, cannot verify either way: say which trust it needs before model_signing gives a vaguer error.
    None when the kind of trust given fits the bundle."""
    if roots is None and bundle_is_certificate(sig):
        who = f"the certificate {cert['subject']} (sha256 {cert['sha256'][:16]}...)" if cert else "a certificate"
        return Result(problem=f"{SIGNATURE}: signed with {who}, not a bare key, so {shown} cannot verify it; "
                              "verify it with --root-certs <the issuing CA's root certificate (PEM)>")
    if roots is not None and not bundle_is_certificate(sig):
        hint = None
        with contextlib.suppress(Exception):  # an unreadable bundle: shown without its key hint
            hint = json.loads(sig.read_text(encoding="utf-8"))["verificationMaterial"]["publicKey"]["hint"]
        key = f" (public key sha256 {hint[:16]}...)" if isinstance(hint, str) and hint else ""
        return Result(problem=f"{SIGNATURE}: signed with a bare elliptic-curve key{key}, not a certificate, so "
                              f"the root certificates {shown} cannot verify it; verify it with --public-key "
                              "<the publisher's key.pub>")
    return None


def _failure(exc: Exception, roots: Roots | None, shown: str, signer: str,
             cert: dict[str, str] | None) -> Result | None:
    """model_signing's verification error as one sentence (and, for a certificate, the chain's reason that
    publish's own probe repeats). None for its "Signature mismatch": the signature is authentic and the
    folder changed since, which `_altered` names file by file."""
    from cryptography.exceptions import InvalidSignature
    from OpenSSL.crypto import X509StoreContextError

    if isinstance(exc, X509StoreContextError):
        why = _chain_error(exc)
        # OpenSSL's wording when no given root issued the chain (another CA, or the wrong roots given)
        stranger = any(w in why for w in ("issuer certificate", "self-signed certificate"))
        return Result(problem=f"{SIGNATURE}: its signing certificate {cert['subject'] if cert else ''} (issued by "
                              f"{cert['issuer'] if cert else '?'}) does not chain to the root certificates "
                              f"{shown} ({why})" + ("; it was issued by another CA, or these are not the "
                                                    "publisher's roots" if stranger else ""),
                      chain_error=f"it does not chain to {shown} ({why})")
    if isinstance(exc, InvalidSignature):
        if roots:
            return Result(problem=f"{SIGNATURE}: its signature is not valid for {signer}: the bundle was altered "
                                  "or signed by another key than the certificate's")
        return Result(problem=f"{SIGNATURE}: its signature is not valid for {shown} ({signer}): it was made by "
                              "another key or altered")
    text = str(exc)
    if text.startswith("Key mismatch"):
        return Result(problem=f"{SIGNATURE}: signed by another key, not by {shown} ({signer})")
    if text.startswith("Signing certificate cannot be used for signing"):
        return Result(problem=f"{SIGNATURE}: {signer} allows neither digital signatures nor code signing, "
                              "so model signing refuses it", chain_error="it allows neither digital "
                              "signatures nor code signing")
    if not text.startswith("Signature mismatch"):
        return Result(problem=f"{SIGNATURE}: not a readable OMS signature bundle "
                              f"({type(exc).__name__}: {text.splitlines()[0][:120] if text else ''}); "
                              "it was altered or truncated")
    return None


def _altered(folder: Path, sig: Path, text: str) -> Result:
    """An authentic signature over other content: which files changed, went missing or were added, read from
    the statement model_signing has just authenticated (`text`: its own words, shown if no file differs)."""
    signed, present = _signed_resources(sig), _present(folder)
    altered = sorted(r for r in set(signed) | set(present) if signed.get(r) != present.get(r))
    return Result(problem=altered_sentence(altered, signed, present) if altered else
                  f"{SIGNATURE}: the folder no longer matches its signature ({text[:200]})",
                  altered=altered, signed=signed, present=present)


def altered_sentence(altered: list[str], signed: dict[str, str], present: dict[str, str]) -> str:
    """`model.sig: the folder no longer matches its signature (<files> changed; ...)` in one sentence."""
    parts = []
    for what, files in (("changed", [r for r in altered if r in signed and r in present]),
                        ("missing", [r for r in altered if r not in present]),
                        ("not signed (added)", [r for r in altered if r not in signed])):
        if files:
            parts.append(f"{_names(files)} {what}")
    return (f"{SIGNATURE}: the folder no longer matches its signature ({'; '.join(parts)} since signing); "
            "it was altered after it was signed")
