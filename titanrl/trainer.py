"""The trainer's set-up (assets, model, parallelism, optimizer) and its step.

Until the RL loop lands, a step is the model/data smoke path: every rank prepares its share
of a global batch of manifest prompts (decode, preprocess, tokenize), appends the reference
answer, and takes one optimizer step on the answer tokens' log-likelihood, with the loss
normalised by the global answer-token count (so FSDP's summed gradients equal the
single-process gradient). It exercises everything the RL step will stand on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from titanrl import assets
from titanrl.config import JobConfig, save_resolved
from titanrl.data.manifest import SampleRecord, read_manifest
from titanrl.data.media import MediaError
from titanrl.data.preprocess import MediaSettings, PreparedSample, prepare_sample
from titanrl.data.prompt import PromptEncoder
from titanrl.distributed import DistInfo, all_reduce_sum, build_dp_mesh
from titanrl.metrics import MetricsLogger
from titanrl.models.packed import pack_sequences
from titanrl.models.qwen2_5_vl import Qwen2_5_VLArgs, Qwen2_5_VLModel, load_hf_weights
from titanrl.models.qwen2_5_vl.inputs import make_sequence_input
from titanrl.models.qwen2_5_vl.model import LogprobTargets
from titanrl.optim import build_lr_scheduler, build_optimizer
from titanrl.parallel.parallelize import CompileOptions, parallelize_qwen2_5_vl

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class BadSampleError(RuntimeError):
    pass


@dataclass
class SkipCounter:
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, reason: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1

    def total(self) -> int:
        return sum(self.counts.values())


def epoch_order(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """Sample order of an epoch: a seeded permutation, identical on every rank."""
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


class Trainer:
    def __init__(self, cfg: JobConfig, info: DistInfo) -> None:
        self.cfg = cfg
        self.info = info
        cfg.validate_world_size(info.world_size)
        if info.is_main:
            cfg.run_dir.mkdir(parents=True, exist_ok=True)
            save_resolved(cfg, cfg.run_dir / "config.toml")
        torch.manual_seed(cfg.job.seed)

        self.model_dir = assets.model_dir(cfg, info)
        self.manifest = assets.manifest_path(cfg, info)
        self.records: list[SampleRecord] = read_manifest(self.manifest, check_files=False)
        self.encoder = PromptEncoder.from_pretrained(self.model_dir)
        self.media_settings = MediaSettings.from_checkpoint(
            self.model_dir,
            fps=cfg.data.fps,
            max_frames=cfg.data.max_frames,
            video_backend=cfg.data.video_backend,
            min_pixels=cfg.data.min_pixels,
            max_pixels=cfg.data.max_pixels,
        )

        self.args = Qwen2_5_VLArgs.from_pretrained(self.model_dir)
        model = Qwen2_5_VLModel(self.args)
        load_hf_weights(model, self.model_dir)
        model.set_attention_backend(cfg.model.attn_backend)
        model.to(info.device)
        self.param_dtype = _DTYPES[cfg.model.dtype]
        self.model = parallelize_qwen2_5_vl(
            model,
            dp_mesh=build_dp_mesh(info),
            compile_options=CompileOptions(
                enable=cfg.compile.enable and "model" in cfg.compile.components,
                backend=cfg.compile.backend,
                dynamic=cfg.compile.dynamic,
            ),
            activation_checkpoint="none" if cfg.parallelism.activation_checkpoint == "none" else "full",
            param_dtype=self.param_dtype,
            reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward,
        )
        self.optimizer = build_optimizer(cfg, self.model.parameters())
        self.lr_scheduler = build_lr_scheduler(cfg, self.optimizer)
        self.metrics = MetricsLogger(
            cfg.run_dir, enabled=info.is_main, jsonl=cfg.metrics.jsonl, tensorboard=cfg.metrics.tensorboard,
            total_steps=cfg.job.steps,
        )
        self.skips = SkipCounter()
        self.step = 0

    # ------------------------------------------------------------------ data

    def global_batch_indices(self, step: int) -> list[int]:
        n = len(self.records)
        bs = self.cfg.rl.global_batch_size
        start = step * bs
        out = []
        for i in range(start, start + bs):
            epoch, pos = divmod(i, n)
            out.append(int(epoch_order(n, self.cfg.job.seed, epoch)[pos]))
        return out

    def prepare(self, index: int) -> PreparedSample | None:
        record = self.records[index]
        try:
            prepared = prepare_sample(record, self.manifest.parent, self.encoder, self.media_settings)
        except MediaError as e:
            return self._bad(record, "media", str(e))
        if len(prepared.prompt_ids) > self.cfg.data.max_prompt_tokens:
            return self._bad(
                record, "too_long",
                f"prompt has {len(prepared.prompt_ids)} tokens > data.max_prompt_tokens={self.cfg.data.max_prompt_tokens}",
            )
        return prepared

    def _bad(self, record: SampleRecord, reason: str, detail: str) -> None:
        if self.cfg.data.on_bad_sample == "error":
            raise BadSampleError(f"sample {record.id!r} ({self.manifest}): {detail}")
        self.skips.add(reason)
        print(f"[titanrl] rank {self.info.rank}: skipping sample {record.id!r}: {detail}", flush=True)
        return None

    # ------------------------------------------------------------------ step

    def smoke_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        indices = self.global_batch_indices(self.step)[self.info.rank :: self.info.world_size]
        prepared = [p for p in (self.prepare(i) for i in indices) if p is not None]
        seqs, targets = [], []
        offset = 0
        for p in prepared:
            answer = self.encoder.encode_text(p.record.answer + "<|im_end|>")
            ids = np.concatenate([p.prompt_ids, answer])
            pixels = torch.from_numpy(p.pixel_values) if p.pixel_values is not None else None
            seqs.append(make_sequence_input(self.args, ids, p.grids, pixels))
            # answer token j is predicted at position (its index - 1)
            first = offset + len(p.prompt_ids)
            targets.append(np.arange(first - 1, first - 1 + len(answer)))
            offset += len(ids)
        t_data = time.perf_counter() - t0

        t1 = time.perf_counter()
        local_targets = sum(len(t) for t in targets)
        counts = all_reduce_sum(torch.tensor([float(local_targets), float(offset)]))
        global_targets, global_tokens = counts.tolist()
        if seqs:
            batch = pack_sequences(seqs).to(self.info.device, self.param_dtype)
            positions = torch.from_numpy(np.concatenate(targets)).to(self.info.device)
            out = self.model(batch, LogprobTargets(positions=positions, token_ids=batch.input_ids[positions + 1]))
            loss = -out.logprobs.sum() / max(global_targets, 1.0)
        else:
            raise BadSampleError(f"rank {self.info.rank} has no usable sample at step {self.step}")
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.cfg.optimizer.max_grad_norm or float("inf")
        )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        t_update = time.perf_counter() - t1

        reduced = all_reduce_sum(torch.tensor([loss.item(), float(self.skips.total())]))
        self.step += 1
        return {
            "loss": reduced[0].item(),
            "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm),
            "lr": self.lr_scheduler.get_last_lr()[0],
            "throughput/tokens_per_s": global_tokens / max(t_data + t_update, 1e-9),
            "time/data": t_data,
            "time/update": t_update,
            "data/skipped": reduced[1].item(),
        }

    def train(self) -> list[dict[str, float]]:
        history = []
        while self.step < self.cfg.job.steps:
            metrics = self.smoke_step()
            history.append(metrics)
            self.metrics.log(self.step, metrics)
        self.metrics.close()
        return history
