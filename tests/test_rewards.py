"""Rewards that say what is correct: built-ins, spec loading, the runner's timeouts and errors, metrics."""

from __future__ import annotations

import textwrap

import pytest

from titanrl.config.errors import ConfigError
from titanrl.config.job_config import REWARD_BUILTINS, RLConfig
from titanrl.data.manifest import SampleRecord
from titanrl.rl import rewards
from titanrl.rl.reward_runner import (RewardError, RewardResult, RewardRunner, normalize_output, reward_metrics,
                                      reward_sums)


def rec(answer: str, choices: list[str] | None = None, id: str = "s0") -> SampleRecord:
    return SampleRecord(id=id, source="any", prompt="q", media=[], answer=answer, answer_choices=choices or [])


def test_builtin_names_match_the_config_list():
    assert set(REWARD_BUILTINS) == set(rewards.BUILTIN_REWARDS)


# math-verify's README example (https://github.com/huggingface/Math-Verify): the gold is a LaTeX set
# expression in a \boxed{} followed by noise, the answer the equal set.
def test_math_agrees_with_math_verify_documented_example():
    from math_verify import parse, verify

    gold_text = "The answer is \\boxed{${1,3} \\cup {2,4}$} What if I add some bad in the end"
    answer_text = "${1,2,3,4}$"
    assert verify(parse(gold_text), parse(answer_text)) is True
    assert rewards.math(answer_text, rec(gold_text))["correct"] == 1.0
    assert rewards.math("${1,2,3,5}$", rec(gold_text))["correct"] == 0.0


@pytest.mark.parametrize("response,answer,correct", [
    (r"so the result is \boxed{0.5}", "1/2", 1.0),
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"The area is $\frac{3}{4}$.", r"\frac{3}{4}", 1.0),
    (r"\boxed{13}", "12", 0.0),
    ("no answer here", "12", 0.0),
    (r"\boxed{x+1}", "1 + x", 1.0),
])
def test_math_reward(response, answer, correct):
    out = rewards.math(response, rec(answer))
    assert out == {"score": correct, "correct": correct}


@pytest.mark.parametrize("response,answer,choices,correct", [
    ("B", "B", [], 1.0),
    ("The answer is (C).", "C", [], 1.0),
    (r"\boxed{A}", "A", [], 1.0),
    ("A", "B", [], 0.0),
    ("green", "green", ["red", "green", "blue"], 1.0),  # option text, answer given as text
    ("(B) green", "green", ["red", "green", "blue"], 1.0),  # letter of the answer's option
    ("Answer: A", "green", ["red", "green", "blue"], 0.0),
])
def test_choice_reward(response, answer, choices, correct):
    assert rewards.choice(response, rec(answer, choices))["correct"] == correct


def test_exact_reward_normalises_case_space_period():
    assert rewards.exact("  Paris. ", rec("paris"))["correct"] == 1.0
    assert rewards.exact(r"it is \boxed{Paris}", rec("Paris"))["correct"] == 1.0
    assert rewards.exact("Lyon", rec("Paris"))["correct"] == 0.0


def test_load_reward_builtin_module_and_file(tmp_path):
    assert rewards.load_reward("math") is rewards.math
    assert rewards.load_reward("titanrl.rl.rewards:choice") is rewards.choice
    f = tmp_path / "my_reward.py"
    f.write_text("def score(response, sample):\n    return float(response == sample.answer)\n")
    fn = rewards.load_reward(f"{f}:score")
    assert fn("x", rec("x")) == 1.0
    with pytest.raises(ConfigError, match="no file"):
        rewards.load_reward(f"{tmp_path / 'missing.py'}:score")
    with pytest.raises(ConfigError, match="has no 'nope'"):
        rewards.load_reward(f"{f}:nope")


def test_a_worker_that_exits_before_it_is_ready_is_named(tmp_path):
    """The worker process dies while importing (here: the reward file exits in any child process; the same as an
    unguarded script that starts training): a RewardError with its exit code and the likely cause, not EOFError."""
    f = tmp_path / "exits_in_child.py"
    f.write_text("import multiprocessing, os\nif multiprocessing.parent_process() is not None:\n    os._exit(3)\n"
                 "def score(response, sample):\n    return 1.0\n")
    with pytest.raises(RewardError, match=r"exited with code 3 before it was ready.*__name__ == '__main__'"):
        RewardRunner(f"{f}:score", workers=1)


@pytest.mark.parametrize("spec,ok", [
    ("math", True), ("pkg.mod:fn", True), ("rewards/my_reward.py:score", True), ("/abs/r.py:f", True),
    ("nope", False), ("pkg.mod", False), ("r.py", False),
])
def test_reward_spec_shape(spec, ok):
    found = [p for p in RLConfig(reward=spec).problems() if p.startswith("rl.reward")]
    assert (not found) == ok, found


def test_normalize_output():
    assert normalize_output(0.5) == RewardResult(score=0.5)
    assert normalize_output({"score": 1, "correct": True, "len": 3}) == RewardResult(1.0, 1.0, {"len": 3.0})
    with pytest.raises(ValueError, match="non-finite"):
        normalize_output(float("nan"))
    with pytest.raises(ValueError, match="reserved"):
        normalize_output({"score": 1, "accuracy": 1})
    with pytest.raises(ValueError, match="without 'score'"):
        normalize_output({"correct": 1})


def test_accuracy_follows_correct_and_float_reward_logs_none():
    with_correct = [RewardResult(1.0, 1.0, {"format": 1.0}), RewardResult(0.1, 0.0, {"format": 0.0}),
                    RewardResult(0.9, 1.0, {"format": 1.0})]
    m = reward_metrics([reward_sums(with_correct[:2]), reward_sums(with_correct[2:])])  # two ranks
    assert m["reward/accuracy"] == pytest.approx(2 / 3)
    assert m["reward/format"] == pytest.approx(2 / 3)
    assert m["reward/errors"] == 0
    m = reward_metrics([reward_sums([RewardResult(0.3), RewardResult(0.7)])])
    assert "reward/accuracy" not in m
    assert m == {"reward/errors": 0.0}


def test_runner_in_process_counts_nan_as_zero(tmp_path):
    f = tmp_path / "r.py"
    f.write_text("def nan(response, sample):\n    return {'score': float('nan'), 'correct': 1.0}\n")
    runner = RewardRunner(f"{f}:nan", workers=0, on_error="zero")
    [r] = runner.score([("x", rec("x"))])
    assert (r.score, r.correct) == (0.0, 0.0) and "non-finite" in r.error
    assert reward_metrics([reward_sums([r])]) == {"reward/errors": 1.0}
    strict = RewardRunner(f"{f}:nan", workers=0, on_error="error")
    with pytest.raises(RewardError, match="sample 'sid'.*non-finite"):
        strict.score([("x", rec("x", id="sid"))])


@pytest.mark.slow
def test_runner_workers_timeout_exception_and_recovery(tmp_path):
    f = tmp_path / "r.py"
    f.write_text(textwrap.dedent("""
        import time
        def reward(response, sample):
            if response == "sleep":
                time.sleep(60)
            if response == "raise":
                raise KeyError("boom")
            return {"score": float(response == sample.answer), "correct": response == sample.answer}
    """))
    runner = RewardRunner(f"{f}:reward", timeout_s=1.0, workers=1, on_error="zero")
    try:
        items = [("a", rec("a", id="0")), ("sleep", rec("a", id="1")), ("raise", rec("a", id="2")),
                 ("b", rec("a", id="3")), ("a", rec("a", id="4"))]
        results = runner.score(items)
        assert [r.score for r in results] == [1.0, 0.0, 0.0, 0.0, 1.0]
        assert "timed out" in results[1].error and "KeyError" in results[2].error
        assert results[3].error is None and results[3].correct == 0.0
        m = reward_metrics([reward_sums(results)])
        assert m["reward/errors"] == 2 and m["reward/accuracy"] == pytest.approx(2 / 5)
    finally:
        runner.close()
    strict = RewardRunner(f"{f}:reward", timeout_s=1.0, workers=1, on_error="error")
    try:
        with pytest.raises(RewardError, match="sample '7'.*timed out"):
            strict.score([("sleep", rec("a", id="7"))])
    finally:
        strict.close()


def test_workers_ignore_the_jobs_sigterm_and_a_killed_worker_is_replaced():
    """torchrun forwards a scheduler's SIGTERM to the whole process group: the reward workers leave it to the
    trainer (which checkpoints, then closes them). A worker killed while idle is replaced, the call still scored."""
    import os
    import signal
    import time

    runner = RewardRunner("first_word", timeout_s=10.0, workers=1)
    try:
        worker = runner._workers[0].process
        os.kill(worker.pid, signal.SIGTERM)
        time.sleep(0.5)
        assert worker.is_alive()
        worker.kill()
        worker.join(5)
        [result] = runner.score([("blue", rec("blue"))])
        assert result.error is None and result.correct == 1.0
        assert runner._workers[0].process.pid != worker.pid
    finally:
        runner.close()


def test_metrics_per_source():
    """source/<name>/{responses,reward,accuracy}: summed over ranks; accuracy only where the reward says what is
    correct; names made safe for metric keys."""
    from types import SimpleNamespace

    from titanrl.rl.step_metrics import source_metrics, source_sums

    def traj(source, reward, correct):
        return SimpleNamespace(prompt=SimpleNamespace(record=SimpleNamespace(source=source)), reward=reward,
                               extras={"reward": RewardResult(reward, correct)})

    rank0 = source_sums([traj("geo3k", 1.0, 1.0), traj("geo3k", 0.0, 0.0), traj("my data/v2", 0.5, None)])
    rank1 = source_sums([traj("geo3k", 1.0, 1.0)])
    out = source_metrics([rank0, rank1])
    assert out == {"source/geo3k/responses": 3.0, "source/geo3k/reward": 2 / 3, "source/geo3k/accuracy": 2 / 3,
                   "source/my_data_v2/responses": 1.0, "source/my_data_v2/reward": 0.5}
