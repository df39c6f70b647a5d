"""The rollout seam: what the RL loop hands an engine and what it gets back.

Engines never tokenize or preprocess on the trainer's behalf: a ``RolloutRequest`` carries the
chat text an engine like vLLM expands itself (``prompt_text``) *and* the expanded ids the trainer
will train on (``prompt_ids``), plus the decoded media both sides share. An engine checks that its
own expansion equals ``prompt_ids`` and fails loudly when it does not.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from titanrl.data.preprocess import DecodedMedia, PreparedSample
from titanrl.data.prompt import PromptEncoder
from titanrl.models.vision_grid import VisionGrid

FinishReason = Literal["stop", "length"]


@dataclass
class RolloutRequest:
    """One prompt to sample ``n`` responses for.

    ``key`` makes the request's sampling seed: two requests with the same key and the same call
    seed draw the same noise. Unset, it is a digest of ``prompt_ids`` and the media (shapes and a
    strided sample of the pixels); set it (e.g. to the sample id) when a batch may hold the same
    prompt twice and both copies must sample differently.
    """

    prompt_text: str  # PromptEncoder.render(prompt): one pad per media item (vLLM expands them)
    prompt_ids: np.ndarray  # PromptEncoder.encode(prompt, grids): expanded ids (the trainer's)
    media: list[DecodedMedia] = field(default_factory=list)  # in prompt order
    grids: list[VisionGrid] = field(default_factory=list)  # one per media item
    pixel_values: np.ndarray | None = None  # [sum of grid patches, patch_dim]; HF engine / checks
    key: str | None = None
    # partial rollouts: the response so far (token ids); the engine continues it (with the weights it has now)
    response_prefix: tuple[int, ...] = ()

    @classmethod
    def from_prepared(
        cls, sample: PreparedSample, encoder: PromptEncoder, key: str | None = None
    ) -> "RolloutRequest":
        """The request of a prepared manifest sample (``titanrl.data.preprocess.prepare_sample``)."""
        return cls(
            prompt_text=encoder.render(sample.record.prompt, sample.record.system, sample.record.history),
            prompt_ids=np.asarray(sample.prompt_ids, dtype=np.int64),
            media=list(sample.media),
            grids=list(sample.grids),
            pixel_values=sample.pixel_values,
            key=key,
        )

    def seed_key(self) -> bytes:
        if self.key is not None:
            return b"key:" + self.key.encode()
        h = hashlib.blake2b(digest_size=16)
        h.update(np.ascontiguousarray(self.prompt_ids, dtype=np.int64).tobytes())
        for m in self.media:
            frames = np.ascontiguousarray(m.frames)
            h.update(f"{m.kind}:{frames.shape}:{m.sampled_fps!r}".encode())
            flat = frames.reshape(-1)
            stride = max(1, flat.size // 65536)  # bounded cost for long videos
            h.update(flat[::stride].tobytes())
        return h.digest()


def token_limits(max_new_tokens: int | Sequence[int], count: int) -> list[int]:
    """``RolloutEngine.generate``'s ``max_new_tokens`` as one limit per request."""
    if isinstance(max_new_tokens, int):
        return [max_new_tokens] * count
    limits = [int(m) for m in max_new_tokens]
    if len(limits) != count:
        raise ValueError(f"max_new_tokens gives {len(limits)} limits for {count} requests")
    return limits


def request_seed(seed: int, request: RolloutRequest) -> int:
    """Per-request sampling seed: a function of the call seed and the request only (not of its
    position in the batch or the other requests). 62 bits, so ``seed + i`` for the ``n`` samples
    of a request never overflows and collisions between requests are negligible."""
    h = hashlib.blake2b(digest_size=8)
    h.update(int(seed).to_bytes(16, "little", signed=True))
    h.update(request.seed_key())
    return int.from_bytes(h.digest(), "little") >> 2


@dataclass
class RolloutSample:
    """One sampled response. ``logprobs[i]`` is log p(token_ids[i]) under the engine's weights,
    of the untempered distribution (temperature 1, no top-p truncation: vLLM's "raw_logprobs");
    a stop token that ended the response is included in ``token_ids``. Engines never sample the
    vision pad tokens (``<|image_pad|>``, ``<|video_pad|>``): the trainer could not lay out a
    sequence with pads that have no media behind them."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    text: str = ""
    prompt_tokens: int = 0  # the context the engine computed this response from (prompt and any earlier turns)
    cached_tokens: int | None = None  # of those, read from the engine's prefix cache (None: not reported)


class PromptMismatchError(ValueError):
    """The engine expanded a prompt to different token ids than the trainer's ``prompt_ids``."""


class WeightsMismatchError(ValueError):
    """A weight update does not fit the engine's model; it was rejected before anything loaded."""


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(
        self,
        requests: Sequence[RolloutRequest],
        *,
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int | Sequence[int],
        seed: int,
    ) -> list[list[RolloutSample]]:
        """``n`` samples per request, as ``[request][sample]``; ``max_new_tokens``: one limit for all, or one per
        request (partial rollouts continue responses by what each has left, in one call)."""
        ...

    def score(self, request: RolloutRequest, completion_ids: Sequence[int]) -> list[float]:
        """log p(completion_ids[i] | prompt, completion_ids[:i]) under the engine's weights."""
        ...

    def score_many(self, items: Sequence[tuple[RolloutRequest, Sequence[int]]]) -> list[list[float]]:
        """``score`` of several pairs in one call (every rank of an engine over several ranks calls it)."""
        ...

    def check_update(self, layout: Mapping[str, Any], where: str = "weight push") -> None:
        """WeightsMismatchError unless every tensor of ``layout`` (HF name -> TensorInfo) fits the engine's model."""
        ...

    def update_weights(self, layout: Mapping[str, Any], tensors: Iterable[tuple[str, Any]]) -> float:
        """Replace the weights in place from in-memory (HF name, tensor) pairs that ``layout`` declares (all or
        part of the model); return the seconds it took, cache resets included. Works on a sleeping engine."""
        ...

    def load_weights(self, hf_dir: str | Path) -> float:
        """``update_weights`` from an HF directory's *.safetensors (tests, tools; the trainer's push writes no
        files)."""
        ...

    workers: int
    """Processes that receive a push over the push's process group (``join_weight_group`` / ``receive_weights``:
    the disaggregated placement)."""

    def sleep(self) -> None:
        """Give the engine's device memory back until its next call (``rollout.sleep``; a no-op for an engine
        built without it). generate / score / load_weights wake it as they need."""
        ...

    def close(self, *, collect: bool = True) -> None:
        """Shut the engine down. ``collect=False``: the process ends next, so work that only gives memory back
        (garbage collections) may be skipped."""
        ...


@contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    """Run a block with ``num_threads`` torch threads (<= 0: leave the setting alone)."""
    if num_threads <= 0:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def probe_logprobs(engine: RolloutEngine, request: RolloutRequest, completion_ids: Sequence[int]) -> list[float]:
    """The engine's log-probs of given completion tokens after ``request``'s prompt; the trainer
    compares them with its own after every weight push (fp32: equal to ~1e-6)."""
    return engine.score(request, completion_ids)


def check_prompt_ids(expected: np.ndarray, got: Sequence[int], *, what: str, image_token_id: int,
                     video_token_id: int) -> None:
    """Raise PromptMismatchError naming the first difference between two prompt id lists."""
    exp = np.asarray(expected, dtype=np.int64).reshape(-1)
    act = np.asarray(list(got), dtype=np.int64).reshape(-1)
    if exp.shape == act.shape and np.array_equal(exp, act):
        return

    def pads(ids: np.ndarray) -> str:
        return f"{int((ids == image_token_id).sum())} image / {int((ids == video_token_id).sum())} video pad tokens"

    n = min(len(exp), len(act))
    diff = np.flatnonzero(exp[:n] != act[:n])
    first = int(diff[0]) if len(diff) else n
    lo = max(0, first - 3)
    raise PromptMismatchError(
        f"{what}: the engine's prompt token ids differ from the request's prompt_ids: "
        f"lengths {len(act)} (engine) vs {len(exp)} (request), {pads(act)} vs {pads(exp)}; "
        f"first difference at index {first}: engine {act[lo:first + 4].tolist()} vs request "
        f"{exp[lo:first + 4].tolist()} (from index {lo}). Rendering, tokenizer or vision "
        "preprocessing (pixel limits, video fps) disagree between the engine and the trainer."
    )
