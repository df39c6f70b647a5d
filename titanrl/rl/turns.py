"""Multi-turn rollouts with image observations (``rollout.max_turns > 1``, ``rl.env``).

Each prompt's ``rollout.n`` responses are sampled together (turn 1, as a single-turn rollout); then, turn by turn,
each unfinished trajectory's environment (``titanrl.envs``) reads the turn's response and returns an observation:
its text and images are appended to the trajectory as a user message (the chat template's tokens, each image's
placeholder expanded to its grid), and the engine continues the whole context (``RolloutRequest.response_prefix``,
the observations' images after the prompt's media). The trajectory's response is every turn with the observations
between them; ``Trajectory.generated`` marks the sampled tokens, the only ones scored, trained and probed.

A turn cut at ``rollout.max_new_tokens`` is closed by the template's end-of-turn tokens (context, like the
observation after them) and handed to the environment like any other. A trajectory ends when its environment says
``done``, after ``rollout.max_turns`` turns, when the next turn could pass ``model.max_seq_len``, or when its
environment fails (reward 0, counted).
Every rank calls its engine once per turn, with its unfinished trajectories or none (an engine over several ranks
needs every rank's call), so the number of engine calls does not depend on the data (with partial rollouts too:
each request carries its own token limit).

Partial rollouts (``rollout.tokens_per_update``): a trajectory samples at most that many tokens per step, over its
turns; one that runs out waits for the next step where it stands (mid-turn, or before its next turn), its
environment with it (``Episode``, pickled into checkpoints), and goes on with the weights of the update between.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import numpy as np

from titanrl.data.preprocess import DecodedMedia, MediaSettings, PreparedSample, media_to_patches
from titanrl.data.prompt import PromptEncoder
from titanrl.envs import EnvError, EnvStep, check_step, env_record
from titanrl.rl.batch import Trajectory
from titanrl.rollout import RolloutRequest


@dataclass
class TurnStats:
    """This rank's counts of one step's multi-turn rollouts (summed over ranks for the metrics)."""

    trajectories: int = 0  # these four: of the trajectories counted (``count``)
    turns: int = 0  # turns sampled, over every trajectory
    images: int = 0  # observation images
    context_tokens_max: int = 0
    tool_calls: int = 0  # observations given back in this step (turns continued)
    env_errors: int = 0
    turn_seconds: list = field(default_factory=list)  # the engine's seconds for each turn (every rank calls each)
    # the turns after the first: their contexts' tokens, and those the engine read from its prefix cache (engines
    # that report it: vLLM)
    continued_tokens: int = 0
    continued_cached: int = 0

    def count(self, trajs: Sequence[Trajectory]) -> None:
        """Add the trajectories' own counts: the step's trajectories (those it trains, with partial rollouts)."""
        self.trajectories += len(trajs)
        self.turns += sum(t.turns for t in trajs)
        self.images += sum(len(t.turn_media) for t in trajs)
        self.context_tokens_max = max([self.context_tokens_max, *(t.num_tokens for t in trajs)])

    def metrics(self) -> list[float]:
        return [self.trajectories, self.turns, self.tool_calls, self.images, self.env_errors, self.continued_tokens,
                self.continued_cached]


@dataclass
class TurnSetup:
    """What a multi-turn rollout needs besides the engine and the encoder (``NodeContext.turns``)."""

    make_env: Callable[[Any], Any]  # rl.env's class
    settings: MediaSettings  # the checkpoint's image processing (observation images)
    manifest_dir: str | None  # where the records' media paths start (the environments get them absolute)
    max_turns: int
    max_turn_images: int
    max_context_tokens: int  # model.max_seq_len: a turn that could pass it is not started
    strict: bool  # rl.on_reward_error = "error": an environment error stops the run
    timeout_s: float = 30.0  # rl.env_timeout_s: longest an environment's constructor or step may take


@dataclass
class Episode:
    """A trajectory being rolled out: its environment and where its current turn stands (partial rollouts carry
    unfinished ones from step to step, and checkpoints hold them: the environment is pickled with them)."""

    traj: Trajectory
    env: Any
    request: RolloutRequest  # the prompt's request (its media, its key)
    done: bool = False
    left: int = 0  # tokens it may still sample in this step (rollout.tokens_per_update)
    turn_start: int = 0  # where the current turn's sampled tokens start in the response
    turn_tokens: int = 0  # tokens the current turn has sampled so far


def observation_tokens(encoder: PromptEncoder, settings: MediaSettings, step: EnvStep, last_token: str
                       ) -> tuple[np.ndarray, list[DecodedMedia], list, np.ndarray | None]:
    """An observation's token ids (image placeholders expanded), its images as media, their grids and pixel rows."""
    media = [DecodedMedia("image", image[None], decoded_frames=1) for image in step.images]
    patches = [media_to_patches(m, settings) for m in media]
    grids = [g for _, g in patches]
    pixels = np.concatenate([p for p, _ in patches]).astype(np.float32) if patches else None
    text = encoder.observation_text(step.observation, len(media), last_token)
    return encoder.expand(encoder.encode_text(text), grids), media, grids, pixels


def trajectory_score(extras: dict, score: float) -> float:
    """A multi-turn trajectory's reward from ``rl.reward``'s ``score`` of its last turn: 0 when its environment
    failed (``extras["env_error"]``), its environment's own reward when it gave one (``extras["env_reward"]``)."""
    if "env_error" in extras:
        return 0.0
    return float(extras.get("env_reward", score))


def _within(fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """``fn()`` in a daemon thread, or EnvError after ``timeout_s`` (the thread is left behind: Python cannot stop
    it, and a daemon thread does not hold the process at its exit)."""
    out: dict[str, Any] = {}

    def call() -> None:
        try:
            out["value"] = fn()
        except BaseException as error:  # handed to the caller
            out["error"] = error

    thread = threading.Thread(target=call, name="titanrl-env", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise EnvError(f"{what} did not return within rl.env_timeout_s = {timeout_s:g} s")
    if "error" in out:
        raise out["error"]
    return out["value"]


def _text(encoder: PromptEncoder, ids: Sequence[int]) -> str:
    return encoder.tokenizer.decode(list(ids), skip_special_tokens=True)


def _append(t: Trajectory, ids: Sequence[int], logprobs: Sequence[float], generated: bool, version: int) -> None:
    t.response_ids = np.concatenate([t.response_ids, np.asarray(ids, dtype=np.int64)])
    fill = np.asarray(logprobs, dtype=np.float32) if generated else np.zeros(len(ids), dtype=np.float32)
    t.rollout_logprobs = np.concatenate([t.rollout_logprobs, fill])
    t.token_versions = np.concatenate([t.token_versions, np.full(len(ids), version, dtype=np.int32)])
    t.generated = np.concatenate([t.generated, np.full(len(ids), generated, dtype=bool)])


def _request(e: Episode, key: str) -> RolloutRequest:
    """The request that continues ``e``'s context: the prompt's media and its observations' images, the response so
    far as the prefix."""
    t = e.traj
    return replace(e.request, media=list(e.request.media) + list(t.turn_media), grids=t.grids,
                   pixel_values=t.pixel_values, key=key, response_prefix=tuple(int(x) for x in t.response_ids))


def rollout_turns(engine, encoder: PromptEncoder, setup: TurnSetup, prompts: Sequence[tuple[int, PreparedSample]],
                  requests: Sequence[RolloutRequest], *, n: int, max_new_tokens: int, sampling: dict, version: int,
                  budget: int | None = None, carried: Sequence[Episode] = ()
                  ) -> tuple[dict[int, list[Episode]], TurnStats]:
    """``n`` multi-turn episodes per prompt (``prompts[i]`` = (global position, sample), ``requests[i]`` its
    request); returns them by group, and the step's counts (``TurnStats.count`` adds the trajectories' own).

    Partial rollouts (``budget``: rollout.tokens_per_update): each episode samples at most ``budget`` tokens in this
    call, over its turns; one that runs out is left unfinished (``Episode.done`` false) where it stands, mid-turn or
    before its next turn, and ``carried`` episodes (unfinished ones of earlier calls, advanced in place) go on from
    there with the engine's current weights. A turn still ends at ``max_new_tokens`` sampled tokens."""
    strict = setup.strict
    stats = TurnStats()
    groups: dict[int, list[Episode]] = {}

    def fail(e: Episode, message: str) -> None:
        e.done = True
        where = f"sample {e.traj.prompt.record.id!r} (response {e.traj.response_index}, turn {e.traj.turns})"
        e.traj.extras["env_error"] = f"{where}: {message}"
        stats.env_errors += 1
        if strict:
            raise EnvError(f"rl.env failed on {where}: {message} (rl.on_reward_error = 'error')")

    def sampled(e: Episode, s) -> RolloutRequest | None:
        """``s`` (an engine sample) appended to ``e``; then, where the turn is over, its environment's answer. Returns
        the request of the episode's next engine call in this step, or None (done, or out of budget)."""
        t = e.traj
        _append(t, s.token_ids, s.logprobs, True, version)
        t.finish_reason = s.finish_reason
        e.turn_tokens += len(s.token_ids)
        e.left -= len(s.token_ids)
        if s.finish_reason != "stop" and e.turn_tokens < max_new_tokens:  # cut by the budget, mid-turn
            return None
        t.response_text = _text(encoder, t.response_ids[e.turn_start:])  # the turn's: rl.reward scores the last
        return answered(e)

    def answered(e: Episode) -> RolloutRequest | None:
        t = e.traj
        try:
            if e.env is None:
                record = env_record(t.prompt.record, setup.manifest_dir)
                e.env = _within(lambda: setup.make_env(record), setup.timeout_s, "the environment's constructor")
            env, text = e.env, t.response_text
            step = check_step(_within(lambda: env.step(text), setup.timeout_s, "step"),
                              max_images=setup.max_turn_images)
        except Exception as error:  # the user's code: any failure ends this trajectory, counted
            fail(e, f"{type(error).__name__}: {error}")
            return None
        if step.reward is not None:
            t.extras["env_reward"] = step.reward
        if step.done or t.turns == setup.max_turns:
            e.done = True
            return None
        try:
            last = encoder.tokenizer.decode([int(t.response_ids[-1])], skip_special_tokens=False)
            ids, media, grids, pixels = observation_tokens(encoder, setup.settings, step, last)
        except Exception as error:  # an image the processor cannot take, a template without turns
            fail(e, f"observation: {type(error).__name__}: {error}")
            return None
        if t.num_tokens + len(ids) + max_new_tokens > setup.max_context_tokens:
            e.done = True  # the next turn could pass model.max_seq_len: this response is the answer
            return None
        _append(t, ids, [], False, version)
        t.turn_media += media
        t.turn_grids += grids
        if pixels is not None:
            t.turn_pixels = pixels if t.turn_pixels is None else np.concatenate([t.turn_pixels, pixels])
        stats.tool_calls += 1
        t.turns += 1
        e.turn_start, e.turn_tokens = len(t.response_ids), 0
        return _request(e, f"{e.request.key}:{t.response_index}:t{t.turns}") if e.left > 0 else None

    def call(todo: list[tuple[Episode, RolloutRequest]], seconds: float = 0.0) -> list[tuple[Episode, RolloutRequest]]:
        """The engine call of one round: each episode of ``todo`` samples up to the rest of its turn or of its budget
        (every rank calls, with its episodes or none: an engine over several ranks needs them all); returns the
        episodes' next requests."""
        t0 = time.perf_counter()
        limits = [min(e.left, max_new_tokens - e.turn_tokens) for e, _ in todo]
        outs = engine.generate([r for _, r in todo], n=1, max_new_tokens=limits, **sampling) \
            if engine is not None else []
        following = []
        for (e, _), (s,) in zip(todo, outs):
            if s.cached_tokens is not None:
                stats.continued_tokens += s.prompt_tokens
                stats.continued_cached += s.cached_tokens
            if (request := sampled(e, s)) is not None:
                following.append((e, request))
        stats.turn_seconds.append(seconds + time.perf_counter() - t0)
        return following

    # no partial rollouts: no budget within the step (every turn may sample max_new_tokens)
    limit = budget if budget is not None else setup.max_turns * max_new_tokens
    for e in carried:
        e.left = limit
    # the first call: the prompts' n first turns
    t0 = time.perf_counter()
    results = engine.generate(list(requests), n=n, max_new_tokens=min(limit, max_new_tokens), **sampling) \
        if engine is not None else []
    todo = []
    for (group, prompt), request, samples in zip(prompts, requests, results):
        groups[group] = []
        for k, s in enumerate(samples):
            t = Trajectory(prompt=prompt, group=group, response_index=k, response_ids=np.zeros(0, dtype=np.int64),
                           rollout_logprobs=np.zeros(0, dtype=np.float32), version=version,
                           token_versions=np.zeros(0, dtype=np.int32), generated=np.zeros(0, dtype=bool))
            e = Episode(t, None, request, left=limit)
            groups[group].append(e)
            if (following := sampled(e, s)) is not None:
                todo.append((e, following))
    if budget is None:
        stats.turn_seconds.append(time.perf_counter() - t0)
    else:  # partial rollouts: the carried episodes go on, mid-turn or at their next turn, in the same round
        todo += call([(e, _request(e, f"{e.request.key}:{e.traj.response_index}:t{e.traj.turns}"
                                      f":{len(e.traj.response_ids)}")) for e in carried], time.perf_counter() - t0)
    for _ in range(setup.max_turns - 1):  # a turn ends, or the budget, in each round: max_turns rounds in all
        todo = call(todo)
    return groups, stats


__all__ = ["Episode", "TurnSetup", "TurnStats", "observation_tokens", "rollout_turns", "trajectory_score"]
