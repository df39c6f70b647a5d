"""Evaluation during training ([eval], ``titanrl.rl.evaluation``): the config's rules, the metrics against a hand
computation, the held-out set, and a run's evaluation against one computed without the trainer.

Every equality test that compares a mode with the one-process reference (``train_runs.REFERENCE``: 4 ranks;
2 + 2 disaggregated, asynchronous and over a tensor-parallel engine; unequal rank speeds) also compares their
evaluations (``train_runs.same_evaluations``: the same responses, rewards and ``eval/*`` metrics), so evaluation on
N ranks equals 1 rank in each of them; the resume test (test_rl_loop) shows a resumed run does not repeat one."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import fork_launch
import pytest

from titanrl.config import ConfigError, parse_args
from titanrl.rl.evaluation import EvalResponse, eval_line, eval_metrics

ROOT = Path(__file__).resolve().parents[1]


def _problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_args(list(overrides))
    return str(info.value)


def test_the_config_refuses_what_would_evaluate_nothing_or_the_wrong_thing():
    assert "identical greedy responses" in _problems("--eval.every=1", "--eval.n=4")
    assert "is never evaluated" in _problems("--eval.path=/data/val.jsonl")
    # user data: titanrl cannot make a held-out split of it
    assert "needs eval.path with data.path set" in _problems("--data.path=/data/train.jsonl", "--eval.every=5")
    assert "eval.every must be >= 0" in _problems("--eval.every=-1")
    cfg = parse_args(["--eval.every=5", "--eval.n=4", "--eval.temperature=1.0"])
    assert cfg.eval.enabled and not parse_args([]).eval.enabled


def _response(index, source, k, reward, correct, error=None):
    return EvalResponse(index, f"s{index}", source, k, "text", 3, reward, correct, error)


def test_metrics_equal_a_hand_computation():
    rs = [_response(0, "a", 0, 1.0, 1.0), _response(0, "a", 1, 0.0, 0.0),  # prompt 0: one of two correct
          _response(1, "b", 0, 0.5, 0.0), _response(1, "b", 1, 0.25, 0.0),  # prompt 1: none
          _response(2, "b", 0, 1.0, 1.0), _response(2, "b", 1, 0.0, 0.0, error="ValueError: x")]
    m = eval_metrics(rs, n=2)
    assert m["eval/reward"] == pytest.approx(2.75 / 6)
    assert m["eval/accuracy"] == pytest.approx(2 / 6)
    assert m["eval/source/a/accuracy"] == 0.5 and m["eval/source/b/accuracy"] == pytest.approx(1 / 4)
    assert m["eval/pass@2"] == pytest.approx(2 / 3)  # prompts 0 and 2 have a correct response
    assert m["eval/errors"] == 1 and m["eval/responses"] == 6 and m["eval/response_length_mean"] == 3
    # a reward that does not say what is correct: no accuracy, no pass@n
    m = eval_metrics([_response(0, "a", 0, 0.5, None), _response(0, "a", 1, 0.0, None)], n=2)
    assert "eval/accuracy" not in m and "eval/pass@2" not in m and m["eval/reward"] == 0.25
    line = eval_line(7, {**eval_metrics(rs, 2), "eval/skipped": 1.0}, prompts=3, n=2, seconds=1.25)
    assert line.startswith("[titanrl] eval after step 7: accuracy 0.333 | reward 0.458 | pass@2 0.667 | a 0.500, "
                           "b 0.250 | 3 prompts x 2, 1.2 s | skipped 1 | reward errors 1"), line


def test_bad_held_out_samples_are_counted_or_named():
    """A held-out sample whose header probe shows a problem is skipped and counted (``eval/skipped``), or with
    data.on_bad_sample = "error" stops the run with a line naming it; eval.max_prompts counts usable samples."""
    from types import SimpleNamespace

    from titanrl.data.shadow.types import BadSampleError
    from titanrl.rl.evaluation import Evaluator, usable

    def meta(i, problem=None):
        return SimpleNamespace(problem=problem, record=SimpleNamespace(id=f"s{i}"))

    bad = meta(1, SimpleNamespace(detail="x.png: no such file"))
    table = SimpleNamespace(metas=[meta(0), bad, meta(2), meta(3)], manifest_path=Path("/data/val.jsonl"))
    use, skipped = usable(table, 2)
    assert [m.record.id for m in use] == ["s0", "s2"] and skipped == [bad]
    common = dict(table=table, settings=None, encoder=None, engine=None, rewards=None, assign=None, rank=0, world=1,
                  every=1, n=1, temperature=0.0, max_prompts=0, max_new_tokens=2, seed=0, out_dir=None)
    assert Evaluator(strict=False, **common).describe() == "3 prompts x 1 from /data/val.jsonl (1 skipped)"
    with pytest.raises(BadSampleError, match=r"held-out sample 's1' of /data/val.jsonl: x.png: no such file"):
        Evaluator(strict=True, **common)


def _media_digests(manifest: Path) -> set[str]:
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    return {hashlib.sha256((manifest.parent / m["path"]).read_bytes()).hexdigest() for r in rows for m in r["media"]}


@pytest.mark.parametrize("mixture", ["image-heavy", "arithmetic"])
def test_the_held_out_set_is_never_a_training_sample(tmp_path, mixture):
    """The synthesized held-out set comes from the generator's seed stream past every job.seed: no id and no media
    file of it is one of the training set's (every file differs), and it is built once per cache."""
    from titanrl.assets import eval_manifest_path, manifest_path
    from titanrl.distributed import DistInfo

    import torch

    cfg = parse_args([f"--model.cache_dir={tmp_path}", f"--data.mixture={mixture}", "--data.num_samples=16",
                      "--eval.every=1"])
    info = DistInfo(0, 1, 0, torch.device("cpu"))
    train, held = manifest_path(cfg, info), eval_manifest_path(cfg, info)
    assert held != train and held.parent.name == f"heldout_{mixture}_n8_seed0"  # a quarter of 16, at least 8
    ids = [json.loads(line)["id"] for line in held.read_text().splitlines()]
    train_ids = {json.loads(line)["id"] for line in train.read_text().splitlines()}
    assert len(ids) == 8 and all(i.startswith("heldout-") for i in ids) and not train_ids & set(ids)
    assert not _media_digests(train) & _media_digests(held)
    mtime = held.stat().st_mtime_ns
    assert eval_manifest_path(cfg, info) == held and held.stat().st_mtime_ns == mtime  # built once


@pytest.mark.slow
def test_an_evaluation_equals_one_computed_without_the_trainer(run_cache, tmp_path):
    """The one-process reference's evaluation of the initial weights (8 held-out prompts x 2 responses sampled at
    temperature 1, scored by the signal reward, which says which are correct) equals the same prompts generated on
    one vLLM engine and scored by the reward function called directly (tests/eval_direct.py, a child process):
    every response and reward, and eval/accuracy, eval/reward and eval/pass@2 exactly. The later evaluations
    (steps 2 and 4) are logged too, in the step's own record."""
    from train_runs import evaluations, metrics, reference_run

    run_dir = reference_run(run_cache)
    import tomllib

    # the held-out set of the reference's mixture (the cache holds every run's of the session)
    mixture = tomllib.loads((run_dir / "config.toml").read_text())["data"]["mixture"]
    held = sorted((Path(run_cache) / "data").glob(f"heldout_{mixture}_*/manifest.jsonl"))
    assert len(held) == 1, held
    out = tmp_path / "direct.json"
    proc = fork_launch.run([sys.executable, str(ROOT / "tests" / "eval_direct.py"), str(run_dir), str(held[0]),
                            str(out)], {**__import__("os").environ, "PYTHONPATH": str(ROOT / "tests")}, ROOT,
                           timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    direct = json.loads(out.read_text())
    evals = evaluations(run_dir)
    assert sorted(evals) == [0, 2, 4]
    assert evals[0] == direct
    m = metrics(run_dir)
    correct = [r["correct"] for r in direct]
    assert 0 < sum(correct) < len(correct)  # the comparison is not all zeros or all ones
    assert m[0]["eval/accuracy"] == sum(correct) / len(correct)
    assert m[0]["eval/reward"] == sum(r["reward"] for r in direct) / len(direct)
    best = {}
    for r in direct:
        best[r["id"]] = max(best.get(r["id"], 0.0), r["correct"])
    assert m[0]["eval/pass@2"] == sum(best.values()) / len(best) and m[0]["eval/prompts"] == 8
    for step in (2, 4):  # in the training step's record, beside its loss
        assert "loss" in m[step] and m[step]["eval/responses"] == 16
    assert "loss" not in m[0]
