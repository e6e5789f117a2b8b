"""Paired comparisons of two drafter variants on the same held-apart rows or prompts.

Two variants' top-1 agreement with the bf16 drafter is compared row by row (the drafter checks
store one match bit per held-apart row): only the rows where exactly one variant agrees carry
information, and under "no difference" each of them is a fair coin, so the exact two-sided
binomial (McNemar) test gives the p-value. Acceptance length tau is compared with a paired
bootstrap over prompts (the same resampled prompts for both variants, seeded).
"""

from __future__ import annotations

import hashlib
from fractions import Fraction
from math import comb
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pipeline.artifacts.check_report import DrafterCheck

BOOTSTRAP_RESAMPLES = 2000


def pack_bits(chunks: list[torch.Tensor]) -> str:
    """Booleans (in order) as hex, 4 rows per digit, most significant first; padded with zeros."""
    bits = "".join("1" if b else "0" for c in chunks for b in c.reshape(-1).tolist())
    bits += "0" * (-len(bits) % 4)
    return "".join(f"{int(bits[i:i + 4], 2):x}" for i in range(0, len(bits), 4))


def unpack_bits(hexbits: str, rows: int) -> list[bool]:
    bits = "".join(f"{int(d, 16):04b}" for d in hexbits)
    return [b == "1" for b in bits[:rows]]


def ids_sha256(chunks: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for c in chunks:
        h.update(c.to(torch.int64).contiguous().numpy().tobytes())
    return h.hexdigest()


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided exact p-value of the binomial test on the discordant rows (p = 1/2 under no difference)."""
    n = only_a + only_b
    if n == 0:
        return 1.0
    tail = sum(comb(n, k) for k in range(min(only_a, only_b) + 1))
    return float(min(Fraction(1), Fraction(2 * tail, 2 ** n)))


def paired_top1(a: DrafterCheck, b: DrafterCheck, key: str = "served") -> dict | None:
    """McNemar comparison of two drafter check reports (`pipeline.artifacts.check_report`) on their `key`
    agreement (`served` or `weights_only`); None when they do not share their rows."""
    ra, rb = getattr(a, key), getattr(b, key)
    if ra is None or rb is None or not ra.top1_match_bits or not rb.top1_match_bits:
        return None
    if (ra.rows != rb.rows or ra.reference_top1_sha256 != rb.reference_top1_sha256
            or a.heldout_sample_ids != b.heldout_sample_ids):
        return None
    ma, mb = unpack_bits(ra.top1_match_bits, ra.rows), unpack_bits(rb.top1_match_bits, rb.rows)
    only_a = sum(x and not y for x, y in zip(ma, mb))
    only_b = sum(y and not x for x, y in zip(ma, mb))
    n = ra.rows
    return {"rows": n, "top1_a": sum(ma) / n, "top1_b": sum(mb) / n, "both": sum(x and y for x, y in zip(ma, mb)),
            "only_a": only_a, "only_b": only_b, "difference": (only_a - only_b) / n,
            "mcnemar_p": mcnemar_exact(only_a, only_b)}


def bootstrap_ratio_difference(a: list[tuple[float, int]], b: list[tuple[float, int]], seed: int,
                               resamples: int = BOOTSTRAP_RESAMPLES) -> dict:
    """Paired bootstrap over units of (sum, count): 95% interval of sum(a)/count(a) - sum(b)/count(b).

    For tau a unit is one prompt: (sum of acceptance lengths, verification steps).
    """
    sa, na = torch.tensor([x for x, _ in a], dtype=torch.float64), torch.tensor([n for _, n in a], dtype=torch.float64)
    sb, nb = torch.tensor([x for x, _ in b], dtype=torch.float64), torch.tensor([n for _, n in b], dtype=torch.float64)
    point = float(sa.sum() / na.sum() - sb.sum() / nb.sum())
    if len(a) == 0:
        return {"difference": point, "ci95": [point, point], "units": 0, "resamples": 0}
    idx = torch.randint(0, len(a), (resamples, len(a)), generator=torch.Generator().manual_seed(seed))
    diffs = sa[idx].sum(1) / na[idx].sum(1).clamp_min(1) - sb[idx].sum(1) / nb[idx].sum(1).clamp_min(1)
    lo, hi = torch.quantile(diffs, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return {"difference": point, "ci95": [lo, hi], "units": len(a), "resamples": resamples,
            "fraction_below_zero": float((diffs < 0).double().mean())}
