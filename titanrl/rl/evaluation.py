"""Evaluation during training ([eval]): held-out prompts generated on every rank's rollout engine and scored with
the run's reward, between steps (collective: every rank calls ``Evaluator.run``).

One direction, as a step's stages: **plan** (every rank alike: the held-out set's metadata from header probes, its
first ``eval.max_prompts`` usable samples, split over the engines by estimated cost with the trainer's own split of
a training batch), **prepare** (each generating rank decodes its share in process: an evaluation is small and
rare, so it does not go through the step's loader), **generate** (``eval.n`` responses per prompt at
``eval.temperature``, top_p 1; a prompt's seed is its id and ``job.seed``, never its rank or the evaluation, so any
world size draws the same responses and two evaluations differ only by the weights), **score** (``rl.reward`` in the
rank's reward workers), **gather** (every response to every rank; rank 0 writes them to
``<run dir>/eval/step-<N>.jsonl``) and **reduce** (the ``eval/*`` metrics and the console line).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from titanrl.data.preprocess import MediaSettings, prepare_sample
from titanrl.data.shadow.metadata import MetadataTable, SampleMeta
from titanrl.data.shadow.types import BadSampleError
from titanrl.distributed import all_gather_objects
from titanrl.metrics import source_key
from titanrl.rl.turns import rollout_turns, trajectory_score
from titanrl.rollout.types import RolloutRequest

# the sampling seed of every evaluation (with job.seed): distinct from the training steps' (job.seed * 1_000_003 +
# step), so an evaluation never draws a training step's noise
_EVAL_STREAM = 999_999_937


@dataclass(frozen=True)
class EvalResponse:
    """One scored response of the held-out set (what ``eval/step-<N>.jsonl`` holds per line)."""

    index: int  # the prompt's line in the held-out manifest
    id: str
    source: str
    response_index: int
    response: str
    tokens: int
    reward: float
    correct: float | None
    error: str | None

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "source": self.source, "response_index": self.response_index,
                "response": self.response, "tokens": self.tokens, "reward": self.reward, "correct": self.correct,
                **({"error": self.error} if self.error else {})}


def usable(table: MetadataTable, max_prompts: int) -> tuple[list[SampleMeta], list[SampleMeta]]:
    """The held-out samples an evaluation uses (the first ``max_prompts`` without a problem; 0: all) and the
    samples skipped on the way (their header probe shows a problem)."""
    use, bad = [], []
    for meta in table.metas:
        if max_prompts and len(use) == max_prompts:
            break
        (bad if meta.problem is not None else use).append(meta)
    return use, bad


def eval_metrics(responses: Sequence[EvalResponse], n: int) -> dict[str, float]:
    """``eval/reward`` (mean over responses), ``eval/accuracy`` and ``eval/source/<name>/accuracy`` (over the
    responses whose reward says what is correct), ``eval/pass@n`` (n > 1: the mean over prompts of their best
    response's correctness), ``eval/response_length_mean``, ``eval/responses`` and ``eval/errors``."""
    out: dict[str, float] = {"eval/responses": float(len(responses)),
                             "eval/errors": float(sum(r.error is not None for r in responses))}
    if not responses:
        return out
    out["eval/reward"] = sum(r.reward for r in responses) / len(responses)
    out["eval/response_length_mean"] = sum(r.tokens for r in responses) / len(responses)
    judged = [r for r in responses if r.correct is not None]
    if judged:
        out["eval/accuracy"] = sum(r.correct for r in judged) / len(judged)
        sources: dict[str, list[float]] = {}
        for r in judged:
            sources.setdefault(r.source, []).append(r.correct)
        for name, values in sorted(sources.items()):
            out[f"eval/source/{source_key(name)}/accuracy"] = sum(values) / len(values)
        if n > 1:
            best: dict[int, float] = {}
            for r in judged:
                best[r.index] = max(best.get(r.index, 0.0), r.correct)
            out[f"eval/pass@{n}"] = sum(best.values()) / len(best)
    return out


def eval_line(step: int, metrics: dict[str, float], prompts: int, n: int, seconds: float) -> str:
    """The console line of one evaluation."""
    when = "before training" if step == 0 else f"after step {step}"
    parts = []
    if "eval/accuracy" in metrics:
        parts.append(f"accuracy {metrics['eval/accuracy']:.3f}")
    if "eval/reward" in metrics:
        parts.append(f"reward {metrics['eval/reward']:.3f}")
    if f"eval/pass@{n}" in metrics:
        parts.append(f"pass@{n} {metrics[f'eval/pass@{n}']:.3f}")
    sources = [(k.split("/")[2], v) for k, v in metrics.items() if k.startswith("eval/source/")]
    if len(sources) > 1:
        parts.append(", ".join(f"{name} {v:.3f}" for name, v in sources))
    parts.append(f"{prompts} prompts x {n}, {seconds:.1f} s")
    if metrics.get("eval/skipped"):
        parts.append(f"skipped {int(metrics['eval/skipped'])}")
    if metrics.get("eval/errors"):
        parts.append(f"reward errors {int(metrics['eval/errors'])}")
    return f"[titanrl] eval {when}: " + " | ".join(parts)


class Evaluator:
    """The held-out set and what evaluating it needs on this rank: ``engine`` and ``rewards`` where it generates
    (None elsewhere), ``assign(metas, world, n)`` the trainer's split of prompts over the engines."""

    def __init__(self, *, table: MetadataTable, settings: MediaSettings, encoder: Any, engine: Any, rewards: Any,
                 assign: Callable[..., list[list[int]]], rank: int, world: int, every: int, n: int,
                 temperature: float, max_prompts: int, max_new_tokens: int, seed: int, strict: bool,
                 out_dir: Path | None, turns: Any = None) -> None:
        self.table, self.settings, self.encoder = table, settings, encoder
        self.engine, self.rewards, self.assign = engine, rewards, assign
        self.rank, self.world = rank, world
        self.every, self.n, self.temperature = every, n, temperature
        self.max_new_tokens, self.seed = max_new_tokens, seed * 1_000_003 + _EVAL_STREAM
        self.strict = strict  # data.on_bad_sample = "error": a bad held-out sample stops the run, named
        self.out_dir = out_dir  # rank 0: where each evaluation's responses go
        self.turns = turns  # multi-turn rollouts (titanrl.rl.turns.TurnSetup): the environment answers each turn
        self.metas, self.bad = usable(table, max_prompts)
        if strict and self.bad:
            raise BadSampleError(self._bad_line(self.bad[0].record.id, self.bad[0].problem.detail))

    def _bad_line(self, sample_id: str, detail: str) -> str:
        return f"held-out sample {sample_id!r} of {self.table.manifest_path}: {detail} (data.on_bad_sample)"

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def describe(self) -> str:
        return (f"{len(self.metas)} prompts x {self.n} from {self.table.manifest_path}"
                + (f" ({len(self.bad)} skipped)" if self.bad else ""))

    def run(self, step: int) -> tuple[dict[str, float], str]:
        """One evaluation (collective): the ``eval/*`` metrics (the same on every rank) and the console line."""
        t0 = time.perf_counter()
        share = self.assign(self.metas, self.world, self.n)[self.rank]
        mine: list[EvalResponse] = []
        skipped: list[str] = []
        if self.engine is not None:
            mine, skipped = self._generate([self.metas[i] for i in share])
        gathered = all_gather_objects((mine, skipped))
        responses = sorted((r for g in gathered for r in g[0]), key=lambda r: (r.index, r.response_index))
        metrics = eval_metrics(responses, self.n)
        metrics["eval/prompts"] = float(len({r.index for r in responses}))
        metrics["eval/skipped"] = float(len(self.bad) + sum(len(g[1]) for g in gathered))
        seconds = time.perf_counter() - t0
        metrics["eval/seconds"] = seconds
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with open(self.out_dir / f"step-{step}.jsonl", "w") as f:
                for r in responses:
                    f.write(json.dumps(r.to_json()) + "\n")
        return metrics, eval_line(step, metrics, int(metrics["eval/prompts"]), self.n, seconds)

    def _generate(self, metas: list[SampleMeta]) -> tuple[list[EvalResponse], list[str]]:
        """This rank's share: prepared, generated and scored. An engine over several ranks is called by each of
        them (with prompts or none)."""
        prepared, skipped = [], []
        for meta in metas:
            try:
                prepared.append((meta, prepare_sample(meta.record, self.table.manifest_path.parent, self.encoder,
                                                      self.settings)))
            except Exception as err:  # an undecodable file: counted, or named (data.on_bad_sample = "error")
                if self.strict:
                    raise BadSampleError(self._bad_line(meta.record.id, f"{type(err).__name__}: {err}")) from err
                skipped.append(meta.record.id)
        requests = [RolloutRequest.from_prepared(p, self.encoder, key=f"eval:{meta.record.id}") for meta, p in prepared]
        sampling = dict(temperature=self.temperature, top_p=1.0, seed=self.seed)
        if self.turns is not None:  # each response its trajectory's last turn; an environment's reward replaces it
            groups, _ = rollout_turns(self.engine, self.encoder, self.turns, list(enumerate(p for _, p in prepared)),
                                      requests, n=self.n, max_new_tokens=self.max_new_tokens, sampling=sampling,
                                      version=0)
            samples_of = [[(e.traj.response_text, e.traj.num_generated_tokens, e.traj.extras) for e in groups[i]]
                          for i in range(len(prepared))]
        else:
            results = self.engine.generate(requests, n=self.n, max_new_tokens=self.max_new_tokens, **sampling)
            samples_of = [[(self.encoder.tokenizer.decode(list(s.token_ids), skip_special_tokens=True),
                            len(s.token_ids), {}) for s in samples] for samples in results]
        self.engine.sleep()  # rollout.sleep: as after a step's generation
        calls = [(text, meta.record) for (meta, _), group in zip(prepared, samples_of) for text, _, _ in group]
        scores = iter(self.rewards.score(calls) if calls else [])
        out = []
        for (meta, _), group in zip(prepared, samples_of):
            for k, (text, tokens, extras) in enumerate(group):
                result = next(scores)
                correct, error = result.correct, result.error
                if "env_error" in extras:
                    correct, error = 0.0 if correct is not None else None, extras["env_error"]
                out.append(EvalResponse(meta.index, meta.record.id, meta.record.source, k, text, tokens,
                                        trajectory_score(extras, result.score), correct, error))
        return out, skipped


__all__ = ["EvalResponse", "Evaluator", "eval_line", "eval_metrics", "usable"]
