"""Counted errors made visible: the first of each kind on the console once, the run's totals for the summary, and
a stop when a reward fails on every call for ``rl.max_error_steps`` consecutive steps.

With ``rl.on_reward_error = "zero"`` a failed reward call scores 0 and is counted (``reward/errors``); that is
right for a bad sample, but a reward that cannot work at all (a typo in it, a missing package on one rank) would
otherwise train on zeros to the end. ``ErrorWatch.observe`` runs on every rank after each step with the same
metrics; the first rank raises."""

from __future__ import annotations

from typing import Callable

from titanrl.rl.reward_runner import RewardError


class ErrorWatch:
    def __init__(self, max_error_steps: int, reward: str, *, is_main: bool, say: Callable[[str], None]) -> None:
        self.max_error_steps = max_error_steps
        self.reward = reward
        self.is_main = is_main
        self.say = say
        self.first: dict[str, str] = {}  # kind -> the run's first error of it
        self.totals: dict[str, float] = {}
        self.failing_steps: list[int] = []  # the current run of steps whose every reward call failed

    def observe(self, step: int, metrics: dict[str, float], first_errors: dict[str, str]) -> None:
        errors, calls = metrics.get("reward/errors", 0.0), metrics.get("reward/calls", 0.0)
        self.totals["reward"] = self.totals.get("reward", 0.0) + errors
        self.totals["env"] = self.totals.get("env", 0.0) + metrics.get("rollout/env_errors", 0.0)
        for kind, message in first_errors.items():
            if kind not in self.first:
                self.first[kind] = message
                if self.is_main:
                    what, counted = _KINDS[kind]
                    self.say(f"[titanrl] warning: step {step}: {what} failed on {message}; it scores 0 "
                             f"(rl.on_reward_error = zero) and is counted in {counted}; later failures are "
                             "counted, not printed")
        self.failing_steps = self.failing_steps + [step] if calls > 0 and errors >= calls else []
        if self.max_error_steps and len(self.failing_steps) >= self.max_error_steps and self.is_main:
            raise RewardError(
                f"every call of reward {self.reward!r} failed in {len(self.failing_steps)} consecutive steps "
                f"({self.failing_steps[0]}-{self.failing_steps[-1]}, rl.max_error_steps = {self.max_error_steps}); "
                f"the first failure: {self.first.get('reward', '?')}")

    def summary(self) -> list[str]:
        """The summary's lines for counted errors (none when there were none)."""
        lines = []
        for kind, (_, counted) in _KINDS.items():
            failed = int(self.totals.get(kind, 0))
            if failed:
                lines.append(f"  errors     {failed} {_PLURAL[kind]} failed and scored 0 ({counted}); the first: "
                             f"{self.first.get(kind, '?')}")
        return lines


# kind -> (what failed, the metric that counts it)
_KINDS = {"reward": ("a reward call", "reward/errors"), "env": ("an environment step (rl.env)", "rollout/env_errors")}
_PLURAL = {"reward": "reward call(s)", "env": "environment step(s)"}
