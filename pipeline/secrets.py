"""Keep the Hub token out of every file, log line, exception and manifest."""

from __future__ import annotations

import os

_TOKEN_ENVS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "SPECQUANT_HF_TOKEN")
_known: set[str] = set()


def remember(secret: str | None) -> None:
    if secret and len(secret) >= 4:
        _known.add(secret)


def scrub(text: str) -> str:
    secrets = set(_known)
    for env in _TOKEN_ENVS:
        v = os.environ.get(env)
        if v and len(v) >= 4:
            secrets.add(v)
    for s in sorted(secrets, key=len, reverse=True):
        text = text.replace(s, "***")
    return text


def scrub_obj(obj):
    """Scrub secrets from every string inside a JSON-like object."""
    if isinstance(obj, str):
        return scrub(obj)
    if isinstance(obj, dict):
        return {scrub_obj(k): scrub_obj(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [scrub_obj(v) for v in obj]
    return obj
