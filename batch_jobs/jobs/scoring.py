"""Scorers for offline evals and the confidence interval of a score.

Each scorer maps (output, reference) to 0 or 1, so an eval's score is a proportion and its 95 %
interval is Wilson's (well-behaved at 0, 1 and small n, unlike the normal approximation).

=========  ===========================================================================
scorer     correct when
=========  ===========================================================================
exact      normalised output == normalised reference
contains   normalised reference occurs in normalised output
regex      ``pattern`` (or, without one, the reference as a pattern) matches the output
judge      the judge model answers YES to "does the answer match the reference?"
=========  ===========================================================================

Example::

    score_item("exact", " Paris. ", "paris")            # 1 (case, spaces and final dots ignored)
    wilson_interval(45, 50)                           # (0.786..., 0.956...)
"""

from __future__ import annotations

import math
import re
from typing import Literal

import regex

__all__ = [
    "JUDGE_PROMPT",
    "MAX_PATTERN",
    "ScorerName",
    "compile_pattern",
    "judge_verdict",
    "normalise",
    "score_item",
    "wilson_interval",
]

ScorerName = Literal["exact", "contains", "regex", "judge"]
MAX_PATTERN = 256
MAX_SCANNED = 10_000  # characters of an output a pattern looks at
REGEX_TIMEOUT_S = 0.05  # a pathological pattern gives up instead of hanging the finaliser

JUDGE_PROMPT = (
    "You grade answers. Reply with exactly YES if the answer matches the reference answer, "
    "otherwise NO.\n\nQuestion:\n{prompt}\n\nReference answer:\n{reference}\n\nAnswer:\n{output}\n\n"
    "Does the answer match the reference? Reply YES or NO."
)

_SPACES = re.compile(r"\s+")


def normalise(text: str) -> str:
    """Lower case, single spaces, no surrounding spaces or final punctuation."""
    return _SPACES.sub(" ", text).strip().rstrip(".!?").strip().lower()


def compile_pattern(pattern: str) -> regex.Pattern[str]:
    if len(pattern) > MAX_PATTERN:
        raise ValueError(f"patterns are limited to {MAX_PATTERN} characters")
    try:
        return regex.compile(pattern)
    except regex.error as exc:
        raise ValueError(f"not a valid pattern: {exc}") from None


def score_item(scorer: ScorerName, output: str, reference: str, *, pattern: str | None = None) -> int:
    """1 if ``output`` is correct for ``reference`` under ``scorer`` (not ``judge``), else 0."""
    if scorer == "exact":
        return int(normalise(output) == normalise(reference))
    if scorer == "contains":
        return int(normalise(reference) in normalise(output))
    if scorer == "regex":
        compiled = compile_pattern(pattern if pattern is not None else reference)
        try:
            return int(compiled.search(output[:MAX_SCANNED], timeout=REGEX_TIMEOUT_S) is not None)
        except TimeoutError:
            return 0
    raise ValueError(f"scorer {scorer!r} needs a judge model")


def judge_verdict(text: str) -> int:
    """1 when the judge's reply starts with YES (ignoring case and punctuation)."""
    return int(normalise(text).lstrip("\"'*` ").startswith("yes"))


def wilson_interval(successes: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """95 % Wilson score interval of a proportion; (0, 1) when there is no data."""
    if n <= 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))
