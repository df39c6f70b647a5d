"""Verifiable reward functions, selected by name: ``rl.reward = "package.module:function"``.

A reward function takes the decoded response text and the sample's record (its ``answer`` and
``answer_choices``) and returns a float in [0, 1]. They run on the rank that owns the sample.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Callable, Protocol

from titanrl.data.manifest import SampleRecord


class RewardFn(Protocol):
    def __call__(self, response: str, record: SampleRecord) -> float: ...


_WORD = re.compile(r"[a-z0-9]+")


def first_word(text: str) -> str:
    """The first alphanumeric word, lowercased ("Red." -> "red"; "" if none)."""
    m = _WORD.search(text.lower())
    return m.group(0) if m else ""


def exact_match(response: str, record: SampleRecord) -> float:
    """1 if the response's first word is the answer. For the synthetic task: answers are one word."""
    return 1.0 if first_word(response) == record.answer.strip().lower() else 0.0


def exact_match_with_format(response: str, record: SampleRecord) -> float:
    """0.9 x exact match + 0.1 x "answered with one of the allowed choices" (the Geo3K-style
    accuracy + format split). The format part gives a randomly initialised policy a signal long
    before it is ever right, which a 4-way answer hidden in a large vocabulary otherwise lacks."""
    word = first_word(response)
    choices = {c.strip().lower() for c in record.answer_choices}
    fmt = 1.0 if word in choices else 0.0
    return 0.9 * exact_match(response, record) + 0.1 * fmt


_BOXED = re.compile(r"\\boxed\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def _as_number(text: str) -> Fraction | None:
    text = text.replace(",", "").replace("$", "").strip()
    frac = re.fullmatch(r"\\frac\{(-?\d+)\}\{(\d+)\}", text)
    if frac:
        return Fraction(int(frac.group(1)), int(frac.group(2)))
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def math_answer(response: str, record: SampleRecord) -> float:
    """Geo3K-style checker: the last ``\\boxed{...}`` (else the last number) of the response equals
    the answer, numerically when both parse as numbers (1/2 == 0.5 == \\frac{1}{2}), else as text."""
    boxed = _BOXED.findall(response)
    if boxed:
        predicted = boxed[-1]
    else:
        numbers = _NUMBER.findall(response)
        predicted = numbers[-1] if numbers else response
    a, b = _as_number(predicted), _as_number(record.answer)
    if a is not None and b is not None:
        return 1.0 if a == b else 0.0
    norm = lambda s: re.sub(r"\s+", "", s).lower()  # noqa: E731
    return 1.0 if norm(predicted) == norm(record.answer) else 0.0


def load_reward(spec: str) -> Callable[[str, SampleRecord], float]:
    """Resolve ``"package.module:function"`` or ``"path/to/file.py:function"``; a clear error names what could not be
    found."""
    from titanrl.workflow.functions import load_function

    return load_function(spec, "rl.reward")
