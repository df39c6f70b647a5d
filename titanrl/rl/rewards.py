"""Verifiable reward functions and how ``rl.reward`` names one.

A reward function takes the decoded response text and the sample's record (its ``answer`` and
``answer_choices``) and returns either

- a float: the score (no accuracy is logged for such a reward: it does not say what is correct), or
- a dict with ``"score"`` (float), optionally ``"correct"`` (bool or float in [0, 1]; ``reward/accuracy``
  is its mean) and any other numbers (each logged as ``reward/<name>``, its mean over the step).

``rl.reward`` names one of:

- a built-in by name: ``math`` (Hugging Face's math-verify: LaTeX, fractions, ``\\boxed{}``), ``choice``
  (multiple choice: a letter or an option's text), ``exact`` (normalised string equality),
  ``first_word`` (the response's first word is the answer), ``exact_match_with_format`` (the synthetic
  colour task's default);
- ``package.module:function`` (imported);
- ``path/to/file.py:function`` (a Python file loaded by path; relative paths are relative to the
  current directory).

How rewards are run (worker processes, timeouts, errors) is ``titanrl.rl.reward_runner``.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, Callable, Protocol, Union

from titanrl.data.manifest import SampleRecord

RewardOutput = Union[float, int, bool, dict[str, Any]]


class RewardFn(Protocol):
    def __call__(self, response: str, record: SampleRecord) -> RewardOutput: ...


_WORD = re.compile(r"[a-z0-9]+")


def first_word(text: str) -> str:
    """The first alphanumeric word, lowercased ("Red." -> "red"; "" if none)."""
    m = _WORD.search(text.lower())
    return m.group(0) if m else ""


def exact_match(response: str, record: SampleRecord) -> float:
    """1 if the response's first word is the answer. For the synthetic task: answers are one word."""
    return 1.0 if first_word(response) == record.answer.strip().lower() else 0.0


def first_word_match(response: str, record: SampleRecord) -> dict[str, float]:
    """``exact_match`` as a reward that says what is correct (score = correct = exact match)."""
    correct = exact_match(response, record)
    return {"score": correct, "correct": correct}


def exact_match_with_format(response: str, record: SampleRecord) -> dict[str, float]:
    """0.9 x exact match + 0.1 x "answered with one of the allowed choices" (the Geo3K-style
    accuracy + format split). The format part gives a randomly initialised policy a signal long
    before it is ever right, which a 4-way answer hidden in a large vocabulary otherwise lacks.
    ``correct`` is the exact match; ``format`` the second part."""
    word = first_word(response)
    choices = {c.strip().lower() for c in record.answer_choices}
    fmt = 1.0 if word in choices else 0.0
    correct = exact_match(response, record)
    return {"score": 0.9 * correct + 0.1 * fmt, "correct": correct, "format": fmt}


_BOXED_START = "\\boxed{"


def last_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` (nested braces allowed), or None."""
    start = text.rfind(_BOXED_START)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED_START)
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def _normalise(text: str) -> str:
    text = re.sub(r"\s+", " ", text).strip().lower()
    return text.rstrip(".").strip().strip("$").strip()


def exact(response: str, record: SampleRecord) -> dict[str, float]:
    """Correct when the response (or its last ``\\boxed{}``) equals the answer after normalising
    case, whitespace, a trailing period and surrounding ``$``."""
    boxed = last_boxed(response)
    predicted = boxed if boxed is not None else response
    correct = float(_normalise(predicted) == _normalise(record.answer))
    return {"score": correct, "correct": correct}


def math(response: str, record: SampleRecord) -> dict[str, float]:
    """Correct when math-verify finds the response's final answer (``\\boxed{}``, LaTeX, a number
    or expression) mathematically equal to the sample's answer (``1/2``, ``0.5`` and
    ``\\frac{1}{2}`` agree; sets, intervals and equations are compared as such)."""
    from math_verify import parse, verify

    answer = record.answer.strip()
    gold = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$")
    if not gold:
        gold = parse(answer)
    predicted = parse(response)
    correct = float(bool(gold) and bool(predicted) and verify(gold, predicted))
    return {"score": correct, "correct": correct}


_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*\(?([A-Z])\b\)?", re.IGNORECASE)
_LONE_LETTER = re.compile(r"(?<![A-Za-z])\(?([A-Z])\)?(?![A-Za-z])")


def _gold_letter(record: SampleRecord) -> str | None:
    answer = record.answer.strip()
    if record.answer_choices and answer in record.answer_choices:
        return _LETTERS[record.answer_choices.index(answer)]
    stripped = answer.strip("().: ").upper()
    return stripped if len(stripped) == 1 and stripped in _LETTERS else None


def choice(response: str, record: SampleRecord) -> dict[str, float]:
    """Multiple choice. The answer is a letter (``"B"``) or one of ``answer_choices`` (option i is
    letter i). The response's choice is the last ``\\boxed{}``, else "answer is X" / "answer: X",
    else the first stand-alone capital letter, else an option's text that the response starts
    with; correct when it names the answer's option."""
    gold = _gold_letter(record)
    options = [c.strip().lower() for c in record.answer_choices]
    valid = _LETTERS[: len(options)] if options else _LETTERS
    boxed = last_boxed(response)
    candidates = [boxed.strip()] if boxed is not None else []
    m = _ANSWER_IS.search(response)
    if m:
        candidates.append(m.group(1))
    candidates += [m.group(1) for m in _LONE_LETTER.finditer(response)][:1]
    picked: str | None = None
    for c in candidates:
        c = c.strip("().: ")
        if len(c) == 1 and c.upper() in valid:
            picked = c.upper()
            break
        if c.lower() in options:
            picked = _LETTERS[options.index(c.lower())]
            break
    if picked is None:
        text = _normalise(response)
        for i, option in enumerate(options):
            if option and text.startswith(option):
                picked = _LETTERS[i]
                break
    correct = float(gold is not None and picked == gold)
    return {"score": correct, "correct": correct}


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
    """Geo3K-style checker without dependencies: the last ``\\boxed{...}`` (else the last number) of
    the response equals the answer, numerically when both parse as numbers, else as text. Returns
    a float (no ``correct``); prefer the ``math`` built-in."""
    boxed = last_boxed(response)
    if boxed is not None:
        predicted = boxed
    else:
        numbers = _NUMBER.findall(response)
        predicted = numbers[-1] if numbers else response
    a, b = _as_number(predicted), _as_number(record.answer)
    if a is not None and b is not None:
        return 1.0 if a == b else 0.0
    norm = lambda s: re.sub(r"\s+", "", s).lower()  # noqa: E731
    return 1.0 if norm(predicted) == norm(record.answer) else 0.0


BUILTIN_REWARDS: dict[str, Callable[[str, SampleRecord], RewardOutput]] = {
    "math": math,
    "choice": choice,
    "exact": exact,
    "first_word": first_word_match,
    "exact_match_with_format": exact_match_with_format,
}


def load_reward(spec: str) -> Callable[[str, SampleRecord], RewardOutput]:
    """Resolve a built-in name, ``"package.module:function"`` or ``"path/to/file.py:function"``; a ConfigError
    names the file, module or function that could not be found."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    from titanrl.workflow.functions import load_function

    return load_function(spec, "rl.reward")


def overlong_penalty(length: int, max_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), as a term added to the reward: 0 up to
    ``max_tokens - buffer`` generated tokens, then falling linearly to ``-penalty`` at ``max_tokens`` (and beyond)."""
    if buffer <= 0:
        return 0.0
    start = max_tokens - buffer
    if length <= start:
        return 0.0
    return -penalty * min(length - start, buffer) / buffer
