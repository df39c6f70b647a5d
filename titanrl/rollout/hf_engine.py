"""Baseline rollout engine: transformers' ``Qwen2_5_VLForConditionalGeneration.generate``.

A plain HF generate loop with its KV cache: ``batch_prompts`` requests per ``generate`` call (left
padded, their media concatenated in order) with their ``n`` samples each (``num_return_sequences``),
the way a transformers user batches. It is what the benchmarks compare vLLM against, and a fallback
that needs no vLLM. It runs on this process's CUDA device when there is one
(``torch.cuda.current_device()``, which ``init_distributed`` sets from LOCAL_RANK), else on the CPU.
With ``batch_prompts = 1`` (the trainer's choice) each request is sampled with its own seed, so any
world size samples the same responses; a batch shares one seed (its first
request's), so responses then depend on how requests are grouped.

transformers 5 places text after a video at the video's start + max(h, w) instead of after its last temporal
position (vLLM's and the trainer's rule: the video log-probs differed by ~0.1 on small models and by 0.4-2.6 at 7B
width, benchmarks/gpu_check.json). The engine gives the model the trainer's rule
(``titanrl.models.qwen2_5_vl.positions.mrope_position_ids`` in place of its ``get_rope_index``), so text, images
and video score as the trainer does.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from titanrl.data.preprocess import MediaSettings, media_to_patches
from titanrl.models.qwen2_5_vl.state_dict_adapter import canonical_hf_name
from titanrl.rollout.types import RolloutRequest, RolloutSample, request_seed, token_limits, torch_threads
from titanrl.rollout.weights import (TensorInfo, check_update, checked_stream, file_tensors, read_headers,
                                     weight_files)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _hf_param_name(name: str) -> str:
    """Checkpoint name (either prefix style) -> transformers 5 module name."""
    name = canonical_hf_name(name)
    if name.startswith("visual."):
        return "model." + name
    if name.startswith("model."):
        return "model.language_model." + name[len("model."):]
    return name


def _trainer_rope_index(config):
    """transformers' ``get_rope_index`` with the trainer's positions: [3, B, L] position ids (left padding skipped
    through ``attention_mask``) and each row's delta (max position + 1 - its length), which generate adds to the
    positions of the tokens it appends."""
    from titanrl.models.qwen2_5_vl.positions import mrope_position_ids
    from titanrl.models.vision_grid import VisionGrid

    vision = config.vision_config

    def get_rope_index(input_ids, mm_token_type_ids=None, image_grid_thw=None, video_grid_thw=None,
                       second_per_grid_ts=None, attention_mask=None, **_):
        images = iter(image_grid_thw.tolist() if image_grid_thw is not None else [])
        videos = iter(video_grid_thw.tolist() if video_grid_thw is not None else [])
        seconds = iter(second_per_grid_ts.tolist() if second_per_grid_ts is not None else [])
        position_ids = torch.zeros(3, *input_ids.shape, dtype=input_ids.dtype, device=input_ids.device)
        deltas = []
        for row, ids in enumerate(input_ids):
            keep = attention_mask[row].bool() if attention_mask is not None else torch.ones_like(ids, dtype=torch.bool)
            ids = ids[keep].cpu().numpy()
            vision_run = np.isin(ids, (config.image_token_id, config.video_token_id))
            starts = np.flatnonzero(vision_run & ~np.concatenate(([False], vision_run[:-1])))
            grids = []
            for start in starts:
                video = ids[start] == config.video_token_id
                t, h, w = next(videos if video else images)
                grids.append(VisionGrid(t, h, w, is_video=bool(video),
                                        second_per_grid=float(next(seconds, 1.0)) if video else 1.0))
            pos = mrope_position_ids(ids, grids, image_token_id=config.image_token_id,
                                     video_token_id=config.video_token_id,
                                     spatial_merge_size=vision.spatial_merge_size,
                                     tokens_per_second=float(vision.tokens_per_second))
            position_ids[:, row, keep] = torch.from_numpy(pos).to(position_ids.device)
            deltas.append(int(pos.max()) + 1 - len(ids) if len(ids) else 0)
        return position_ids, torch.tensor(deltas, device=input_ids.device).unsqueeze(1)

    return get_rope_index


class HFGenerateEngine:
    """``RolloutEngine`` on transformers' generate (the baseline)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str = "float32",
        fps: float = 2.0,
        max_frames: int = 8,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        num_threads: int = 0,
        banned_token_ids: Sequence[int] | None = None,
        batch_prompts: int = 1,
        sleep: bool = False,
    ) -> None:
        from transformers import AutoTokenizer, GenerationConfig, Qwen2_5_VLForConditionalGeneration

        if batch_prompts < 1:
            raise ValueError(f"batch_prompts must be >= 1, got {batch_prompts}")
        self.model_dir = Path(model_dir)
        self.num_threads = num_threads
        self.batch_prompts = batch_prompts
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        t0 = time.perf_counter()
        self.model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            str(self.model_dir), dtype=_DTYPES[dtype]
        ).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        gen = GenerationConfig.from_pretrained(str(self.model_dir))
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.tokenizer.eos_token_id
        self.eos_ids = set([eos] if isinstance(eos, int) else list(eos))
        self.pad_id = gen.pad_token_id if gen.pad_token_id is not None else min(self.eos_ids)
        cfg = self.model.config
        self.image_token_id, self.video_token_id = cfg.image_token_id, cfg.video_token_id
        # As in the vLLM engine: never sample a vision pad token.
        banned = (self.image_token_id, self.video_token_id) if banned_token_ids is None else banned_token_ids
        self.suppress = [int(t) for t in banned] or None
        self.settings = MediaSettings.from_checkpoint(
            self.model_dir, fps=fps, max_frames=max_frames, min_pixels=min_pixels, max_pixels=max_pixels
        )
        self._reference = read_headers(self.model_dir)
        self._sleeps, self._asleep = sleep, False  # rollout.sleep
        inner = self.model.model
        inner.get_rope_index = _trainer_rope_index(inner.config)  # the trainer's (and vLLM's) text-after-video rule
        self.start_s = time.perf_counter() - t0

    def _threads(self):
        return torch_threads(self.num_threads)

    def _vision_kwargs(self, request: RolloutRequest, ids: np.ndarray) -> dict[str, Any]:
        return self._batch_vision_kwargs([request], ids[None])

    def _batch_vision_kwargs(self, requests: Sequence[RolloutRequest], ids: np.ndarray) -> dict[str, Any]:
        """Vision inputs of ``requests`` (rows of ``ids``, padded), their media concatenated in order."""
        images, videos = [], []
        dtype = self.model.dtype
        for request in requests:
            grids, pixels = request.grids, request.pixel_values
            if request.media and (pixels is None or len(grids) != len(request.media)):
                patches = [media_to_patches(m, self.settings) for m in request.media]
                grids = [g for _, g in patches]
                pixels = np.concatenate([p for p, _ in patches]).astype(np.float32)
            if not grids:
                continue
            chunks = torch.split(torch.from_numpy(np.asarray(pixels, dtype=np.float32)),
                                 [g.num_patches for g in grids])
            for c, g in zip(chunks, grids):
                (videos if g.is_video else images).append((c, g))
        kwargs: dict[str, Any] = {}
        if images:
            kwargs["pixel_values"] = torch.cat([c for c, _ in images]).to(dtype)
            kwargs["image_grid_thw"] = torch.tensor([[g.t, g.h, g.w] for _, g in images])
        if videos:
            kwargs["pixel_values_videos"] = torch.cat([c for c, _ in videos]).to(dtype)
            kwargs["video_grid_thw"] = torch.tensor([[g.t, g.h, g.w] for _, g in videos])
            kwargs["second_per_grid_ts"] = torch.tensor([g.second_per_grid for _, g in videos])
        if kwargs:
            mm = np.zeros_like(ids)
            mm[ids == self.image_token_id] = 1
            mm[ids == self.video_token_id] = 2
            kwargs["mm_token_type_ids"] = torch.from_numpy(mm)
        return {k: v.to(self.device) for k, v in kwargs.items()}

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
        limits = token_limits(max_new_tokens, len(requests))
        by_limit: dict[int, list[int]] = {}  # one generate call per limit, the requests in their order
        for i, m in enumerate(limits):
            by_limit.setdefault(m, []).append(i)
        out: list = [None] * len(requests)
        self._wake()
        with self._threads(), torch.no_grad():
            for limit, which in sorted(by_limit.items()):
                for start in range(0, len(which), self.batch_prompts):
                    rows = which[start:start + self.batch_prompts]
                    samples = self._generate_batch([requests[i] for i in rows], n=n, temperature=temperature,
                                                   top_p=top_p, max_new_tokens=limit, seed=seed)
                    for i, sample in zip(rows, samples):
                        out[i] = sample
        return out

    def _generate_batch(self, requests: Sequence[RolloutRequest], *, n: int, temperature: float, top_p: float,
                        max_new_tokens: int, seed: int) -> list[list[RolloutSample]]:
        prompts = [np.concatenate([np.asarray(r.prompt_ids, dtype=np.int64), np.asarray(r.response_prefix, dtype=np.int64)])
                   for r in requests]
        width = max(len(p) for p in prompts)
        ids = np.full((len(prompts), width), self.pad_id, dtype=np.int64)  # left padding
        mask = np.zeros((len(prompts), width), dtype=np.int64)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = p
            mask[i, width - len(p):] = 1
        kwargs = self._batch_vision_kwargs(requests, ids)
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p) if temperature > 0 \
            else dict(do_sample=False)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(request_seed(seed, requests[0]) % (2**63))
            res = self.model.generate(
                input_ids=torch.from_numpy(ids).to(self.device),
                attention_mask=torch.from_numpy(mask).to(self.device),
                max_new_tokens=max_new_tokens,
                num_return_sequences=n,
                top_k=0,
                suppress_tokens=self.suppress,
                pad_token_id=self.pad_id,
                eos_token_id=sorted(self.eos_ids),
                return_dict_in_generate=True,
                # the scores generate sampled from (after the suppressed tokens, temperature and top-p): the behaviour
                # log-probs, like vLLM's processed log-probs
                output_scores=True,
                use_cache=True,
                **sampling,
                **kwargs,
            )
        new = res.sequences[:, width:]  # row i * n + j: request i's sample j
        logits = torch.stack(res.scores, dim=1).float()  # [len(requests) * n, steps, V]
        lps = torch.log_softmax(logits, dim=-1).gather(-1, new[..., None])[..., 0].cpu()
        new = new.cpu()
        out = []
        for i in range(len(requests)):
            samples = []
            for row in range(i * n, (i + 1) * n):
                toks = new[row].tolist()
                end = next((k + 1 for k, t in enumerate(toks) if t in self.eos_ids), None)
                reason = "stop" if end is not None else "length"
                end = end if end is not None else len(toks)
                text = self.tokenizer.decode(toks[:end], skip_special_tokens=True)
                samples.append(RolloutSample(toks[:end], lps[row, :end].tolist(), reason, text))
            out.append(samples)
        return out

    def score_many(self, items) -> list[list[float]]:
        return [self.score(request, ids) for request, ids in items]

    def score(self, request: RolloutRequest, completion_ids: Sequence[int]) -> list[float]:
        completion = [int(t) for t in completion_ids]
        if not completion:
            return []
        ids = np.concatenate([np.asarray(request.prompt_ids, dtype=np.int64), np.asarray(completion, dtype=np.int64)])
        self._wake()
        with self._threads(), torch.no_grad():
            logits = self.model(input_ids=torch.from_numpy(ids)[None].to(self.device),
                                **self._vision_kwargs(request, ids)).logits[0]
        start = len(ids) - len(completion)
        lp = torch.log_softmax(logits[start - 1 : len(ids) - 1].float(), dim=-1)
        return lp.gather(-1, torch.tensor(completion, device=self.device)[:, None])[:, 0].tolist()

    def sleep(self) -> None:
        """Give the device memory back until the next generate or score (engine built with ``sleep=True``;
        else nothing): the weights move to host memory (the caching allocator keeps the freed blocks for the
        training stages); a weight push while asleep writes the host copy."""
        if self._sleeps and not self._asleep:
            self.model.to("cpu")
            self._asleep = True

    def _wake(self) -> None:
        if self._asleep:
            self.model.to(self.device)
            self._asleep = False

    workers = 1  # a weight push over the push's process group reaches this process itself

    def check_update(self, layout, where: str = "weight push") -> None:
        check_update(self._reference, layout, where=where)

    def update_weights(self, layout, tensors) -> float:
        """The weights in place from (HF name, tensor) pairs (declared by ``layout``, checked first); a sleeping
        engine's host copy takes them."""
        t0 = time.perf_counter()
        self.check_update(layout)
        params = dict(self.model.state_dict())
        with torch.no_grad():
            for name, tensor in checked_stream(tensors, layout):
                target = _hf_param_name(name)
                if target not in params:
                    raise KeyError(f"{name} has no parameter {target} in the HF model")
                params[target].copy_(tensor)
        return time.perf_counter() - t0

    def load_weights(self, hf_dir: str | Path) -> float:
        return self.update_weights(read_headers(hf_dir), file_tensors(weight_files(hf_dir)))

    def join_weight_group(self, address, world: int, first: int, timeout_s: float) -> None:
        from titanrl.distributed import stateless_group

        self._weight_group = stateless_group(address, first, world, self.device, timeout_s)

    def receive_weights(self, buckets) -> float:
        from titanrl.rl.weight_sync import receive_buckets

        layout = {name: TensorInfo(tuple(shape), dt) for b in buckets for name, shape, dt, _ in b.entries}
        return self.update_weights(layout, receive_buckets(buckets, self._weight_group, self.device))

    def close(self, *, collect: bool = True) -> None:  # nothing to collect: the model goes with its reference
        self.model = None


__all__ = ["HFGenerateEngine"]
