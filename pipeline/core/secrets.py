"""Keep the Hub token (and any PEM private key, e.g. a publish signing key) out of every file, log line,
exception and manifest."""

from __future__ import annotations

import os
import re

_TOKEN_ENVS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "SPECQUANT_HF_TOKEN")
_known: set[str] = set()
# `publish.token=hf_...` on a command line (argv, overrides, the captured command) even before any
# stage has read the token; `token_env=HF_TOKEN` names a variable, not a secret, and is kept
_TOKEN_ARG = re.compile(r"(?<![A-Za-z0-9])(token=)([^\s'\",\]}]+)")
_SECRET_KEYS = frozenset({"token", "hf_token"})  # config keys whose string value is a secret


def remember(secret: str | None) -> None:
    if secret and len(secret) >= 4:
        _known.add(secret)


# a Hugging Face access token wherever it appears (a config file, a diff), known or not
_HF_TOKEN = re.compile(r"(?<![A-Za-z0-9_])hf_[A-Za-z0-9]{20,}(?![A-Za-z0-9])")
# a PEM private key block (PKCS#8, SEC1 "EC", RSA, "ENCRYPTED", OpenSSH): the signing key is read from its path
# and never written, but a key pasted into a config, an env var or a diff is masked wherever it appears
# (a block cut short, with no END line, is masked up to the end of its base64)
_PEM_PRIVATE_KEY = re.compile(r"-----BEGIN ((?:[A-Z0-9]+ )*)PRIVATE KEY-----"
                              r"(?:.*?-----END \1PRIVATE KEY-----|[A-Za-z0-9+/=\s]*)", re.S)
# `token: <value>` in a YAML config (conf/publish/*.yaml documents the field); null / *** / ${...} are kept
_YAML_TOKEN = re.compile(r"(?m)^([+\- ]?\s*(?:hf_)?token\s*:\s*)(?!null\b|~|\*\*\*|\$\{|['\"]?\s*$)(['\"]?)[^\s#'\"]+\2")


def scrub_config_text(text: str) -> str:
    """scrub_values plus any `token:` value of a YAML config (for config files copied into snapshots)."""
    return _YAML_TOKEN.sub(lambda m: m.group(1) + "***", scrub_values(text))


def scrub_values(text: str) -> str:
    """Replace the known secret values (remembered tokens, token env vars) and anything shaped like a
    Hugging Face token or a PEM private key block: safe for source code."""
    text = _PEM_PRIVATE_KEY.sub("***", _HF_TOKEN.sub("***", text))
    secrets = set(_known)
    for env in _TOKEN_ENVS:
        v = os.environ.get(env)
        if v and len(v) >= 4:
            secrets.add(v)
    for s in sorted(secrets, key=len, reverse=True):
        text = text.replace(s, "***")
    return text


def scrub(text: str) -> str:
    """scrub_values, then mask any `token=<value>` on a command line (for logs, argv and configs)."""
    return _TOKEN_ARG.sub(_mask_token_arg, scrub_values(text))


def _mask_token_arg(m: re.Match) -> str:
    value = m.group(2)
    return m.group(1) + (value if value in ("null", "None", "***") else "***")


def scrub_obj(obj):
    """Scrub secrets from every string inside a JSON-like object."""
    if isinstance(obj, str):
        return scrub(obj)
    if isinstance(obj, dict):
        return {scrub_obj(k): "***" if k in _SECRET_KEYS and isinstance(v, str) and v else scrub_obj(v)
                for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [scrub_obj(v) for v in obj]
    return obj
