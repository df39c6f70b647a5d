"""Qwen2.5-VL: vision tower + Qwen2 decoder over packed variable-length sequences.

This file knows nothing about parallelism: FSDP, compile, activation checkpointing and
sequence parallelism are applied from the outside (``titanrl.parallel.parallelize``).
Attention goes through ``self.inner_attention`` (a ``VarlenAttention`` module), the one seam a
sequence-parallel wrapper replaces; the decoder passes ``batch.attention_layout`` to it unread
when a batch carries one (a sharded layout built outside the model).

Input: a ``PackedBatch`` (see ``titanrl.models.packed``): all sequences concatenated into one
token stream with ``cu_seqlens`` boundaries and 3D rotary positions, plus the patches of every
image and video in order of appearance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanrl.models.attention import AttnBackend, VarlenAttention, VarlenMeta, make_varlen_meta
from titanrl.models.packed import PackedBatch
from titanrl.models.qwen2_5_vl.args import Qwen2_5_VLArgs, TextArgs, VisionArgs
from titanrl.models.qwen2_5_vl.positions import (
    VisionGrid,
    vision_frame_cu_seqlens,
    vision_rotary_positions,
    vision_window_index,
)

@dataclass
class LogprobTargets:
    """Which tokens to score: ``token_ids[i]`` as predicted at packed position ``positions[i]``."""

    positions: torch.Tensor  # [K] int64 indices into the packed stream
    token_ids: torch.Tensor  # [K] int64
    temperature: float = 1.0
    return_entropy: bool = False


@dataclass
class ModelOutput:
    hidden: torch.Tensor  # [N, hidden]
    logprobs: torch.Tensor | None = None  # [K] fp32
    entropy: torch.Tensor | None = None  # [K] fp32
    values: torch.Tensor | None = None  # [K] fp32, a critic's (value_head=True) value at each target position


_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the reference, then cast back before scaling.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class GatedMLP(nn.Module):
    """SwiGLU: w2(act(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        self.w3 = nn.Linear(dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, dim, bias=bias)
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, dim]; cos/sin: [tokens, dim]. Computed in fp32."""
    dtype = x.dtype
    x32 = x.float()
    cos, sin = cos[:, None, :].float(), sin[:, None, :].float()
    return (x32 * cos + rotate_half(x32) * sin).to(dtype)


# ---------------------------------------------------------------- vision tower


class VisionAttention(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.num_heads = args.num_heads
        self.head_dim = args.head_dim
        self.qkv = nn.Linear(args.hidden_size, 3 * args.hidden_size, bias=True)
        self.proj = nn.Linear(args.hidden_size, args.hidden_size, bias=True)
        self.inner_attention = VarlenAttention("sdpa")

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: VarlenMeta
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.inner_attention(q, k, v, meta, scale=self.head_dim**-0.5)
        return self.proj(out.reshape(n, -1))


class VisionBlock(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.norm1 = RMSNorm(args.hidden_size, args.norm_eps)
        self.attn = VisionAttention(args)
        self.norm2 = RMSNorm(args.hidden_size, args.norm_eps)
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, args.hidden_act, bias=True)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: VarlenMeta
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, meta)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Concatenates each 2x2 block of patch features and projects it to the LLM width."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.in_dim = args.hidden_size * args.merge_unit
        self.norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.fc1 = nn.Linear(self.in_dim, self.in_dim)
        self.fc2 = nn.Linear(self.in_dim, args.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).view(-1, self.in_dim)
        return self.fc2(F.gelu(self.fc1(x)))


class VisionTransformer(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        # A Conv3d whose stride equals its kernel over pre-flattened patches is a Linear.
        self.patch_embed = nn.Linear(args.patch_dim, args.hidden_size, bias=False)
        self.blocks = nn.ModuleDict({str(i): VisionBlock(args) for i in range(args.depth)})
        self.merger = PatchMerger(args)
        self.attn_backend: AttnBackend = "sdpa"
        head_half = args.head_dim // 2
        inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, head_half, 2, dtype=torch.float) / head_half))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rotary(self, grids: list[VisionGrid], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        hw = vision_rotary_positions(grids, self.args.spatial_merge_size).to(device)
        freqs = hw[..., None].float() * self.inv_freq.float()  # [N, 2, head_dim/4]
        freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, pixel_values: torch.Tensor, grids: list[VisionGrid]) -> torch.Tensor:
        """[num_patches, patch_dim] -> [num_patches / merge_unit, out_hidden_size], in input order."""
        a = self.args
        device = pixel_values.device
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))
        n = x.shape[0]
        window_index, cu_window = vision_window_index(
            grids, window_size=a.window_size, patch_size=a.patch_size, merge=a.spatial_merge_size
        )
        window_index = window_index.to(device)
        full_meta = make_varlen_meta(vision_frame_cu_seqlens(grids).to(device), causal=False, backend=self.attn_backend)
        window_meta = make_varlen_meta(cu_window.to(device), causal=False, backend=self.attn_backend)

        def to_window_order(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(n // a.merge_unit, a.merge_unit, -1)[window_index].reshape(n, -1)

        cos, sin = self.rotary(grids, device)
        x, cos, sin = to_window_order(x), to_window_order(cos), to_window_order(sin)
        for i, block in self.blocks.items():
            if int(i) in a.fullatt_block_indexes:
                x = block(x, cos, sin, full_meta)
            else:
                x = block(x, cos, sin, window_meta)
        merged = self.merger(x)
        return merged[torch.argsort(window_index)]

    def init_weights(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, RMSNorm):
                m.reset_parameters()


# ---------------------------------------------------------------- language model


class Attention(nn.Module):
    def __init__(self, args: TextArgs) -> None:
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.hidden_size, self.n_heads * self.head_dim, bias=True)
        self.wk = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=True)
        self.wv = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=True)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=False)
        self.inner_attention = VarlenAttention("sdpa")

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: object
    ) -> torch.Tensor:
        n = x.shape[0]
        q = self.wq(x).view(n, self.n_heads, self.head_dim)
        k = self.wk(x).view(n, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(n, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.inner_attention(q, k, v, meta, scale=self.head_dim**-0.5)
        return self.wo(out.reshape(n, -1))


class DecoderLayer(nn.Module):
    def __init__(self, args: TextArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.feed_forward = GatedMLP(args.hidden_size, args.intermediate_size, args.hidden_act, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: object
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, meta)
        return x + self.feed_forward(self.ffn_norm(x))


class Qwen2_5_VLModel(nn.Module):
    """Vision tower + decoder. ``forward`` returns final hidden states [tokens, hidden];
    ``logits`` / ``token_logprobs`` project only the positions asked for, so the full
    [tokens, vocab] matrix is never materialised for log-prob computation."""

    def __init__(self, args: Qwen2_5_VLArgs, *, value_head: bool = False) -> None:
        """``value_head``: the critic of PPO - the same network with a scalar head (``values`` at the target
        positions) where the policy has its vocabulary projection."""
        super().__init__()
        self.args = args
        t = args.text
        self.vision = VisionTransformer(args.vision)
        self.tok_embeddings = nn.Embedding(t.vocab_size, t.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(t) for i in range(t.num_hidden_layers)})
        self.norm = RMSNorm(t.hidden_size, t.rms_norm_eps)
        self.attn_backend: AttnBackend = "sdpa"
        if value_head:  # a critic: a scalar per position instead of the vocabulary projection
            self.output = None
            self.value_head = nn.Linear(t.hidden_size, 1)
        else:
            self.output = nn.Linear(t.hidden_size, t.vocab_size, bias=False)
            self.value_head = None
            if t.tie_word_embeddings:
                self.output.weight = self.tok_embeddings.weight
        inv_freq = 1.0 / (t.rope_theta ** (torch.arange(0, t.head_dim, 2, dtype=torch.float) / t.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    # -- construction helpers

    def set_attention_backend(self, backend: AttnBackend) -> None:
        self.attn_backend = self.vision.attn_backend = backend
        for m in self.modules():
            if isinstance(m, VarlenAttention):
                m.set_backend(backend)

    def init_weights(self, std: float = 0.02) -> None:
        """Random init (the trainer normally loads HF weights instead)."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, RMSNorm):
                m.reset_parameters()
        self.reinit_buffers()

    def reinit_buffers(self) -> None:
        """Non-persistent buffers are lost when a model is built on the meta device."""
        t, v = self.args.text, self.args.vision
        device = self.tok_embeddings.weight.device
        if device.type == "meta":
            return
        self.inv_freq = 1.0 / (t.rope_theta ** (torch.arange(0, t.head_dim, 2, dtype=torch.float, device=device) / t.head_dim))
        half = v.head_dim // 2
        self.vision.inv_freq = 1.0 / (v.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float, device=device) / half))

    # -- forward

    def mrope_cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [3, N] -> cos/sin [N, head_dim]: frequency band i takes its angle from
        the t, h or w position according to ``mrope_section``."""
        freqs = position_ids[..., None].float() * self.inv_freq.float()  # [3, N, head_dim/2]
        sections = list(self.args.text.mrope_section)
        freqs = torch.cat([chunk[i % 3] for i, chunk in enumerate(freqs.split(sections, dim=-1))], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def vision_rows(self, batch: PackedBatch, dtype: torch.dtype) -> torch.Tensor:
        """The rows this batch's placeholder tokens read (``batch.vision_token_index`` indexes them): the vision
        tower's output of ``batch.pixel_values``, through ``batch.vision_route`` when one is set (rows encoded on
        other ranks arrive, a collective). No pixels still runs the tower on one zero 2x2 patch block, kept in the
        graph at zero weight: under FSDP every rank must issue the same all-gathers and reduce-scatters, whatever
        media its share of the batch happens to hold."""
        if batch.pixel_values is not None and batch.pixel_values.numel() > 0:
            rows = self.vision(batch.pixel_values, batch.grids).to(dtype)
        else:
            v = self.args.vision
            unused = self.vision(batch.input_ids.new_zeros(v.merge_unit, v.patch_dim, dtype=dtype),
                                 [VisionGrid(1, v.spatial_merge_size, v.spatial_merge_size)]).to(dtype)
            rows = unused[:0] + 0.0 * unused.sum()  # no rows, its backward still reaches the tower
        if batch.vision_route is not None:
            rows = batch.vision_route(rows)
        return rows

    def embed(self, batch: PackedBatch) -> torch.Tensor:
        """Token embeddings with vision features written into the image/video placeholder slots: rows of
        ``batch.vision_embeds`` when set (encoded beforehand, see ``forward(vision_only=True)``), else of the
        vision tower run here (:meth:`vision_rows`)."""
        h = self.tok_embeddings(batch.input_ids)
        if batch.vision_embeds is not None:
            vision_embeds = batch.vision_embeds.rows
        else:
            vision_embeds = self.vision_rows(batch, h.dtype)
        vision_embeds = vision_embeds.to(h.dtype)
        table = vision_embeds
        if batch.vision_token_index is not None:
            vision_embeds = vision_embeds[batch.vision_token_index]
        slots = (batch.input_ids == self.args.image_token_id) | (batch.input_ids == self.args.video_token_id)
        num_slots = int(slots.sum())
        if num_slots != vision_embeds.shape[0]:
            raise ValueError(
                f"{num_slots} image/video placeholder tokens but the vision tower produced "
                f"{vision_embeds.shape[0]} embeddings: prompt expansion and grids disagree"
            )
        if num_slots:
            h = h.masked_scatter(slots[:, None], vision_embeds)
        # rows nothing here reads (a zero patch, routed rows, a table) stay in the graph at zero weight
        return h + 0.0 * table.sum()

    def forward(self, batch: PackedBatch, targets: LogprobTargets | None = None, *,
                vision_only: bool = False) -> ModelOutput:
        """Hidden states of every token, and, when ``targets`` is given, the log-probs (and
        optionally entropies) of the target tokens. Log-probs are computed inside ``forward``
        so a wrapped model (FSDP) has its output projection gathered while they are taken.
        ``vision_only``: only :meth:`vision_rows` of ``batch`` (in ``hidden``), for later forwards to read
        as ``PackedBatch.vision_embeds``; a forward of its own, so a wrapped model gathers what it uses."""
        if vision_only:
            return ModelOutput(hidden=self.vision_rows(batch, self.tok_embeddings.weight.dtype))
        h = self.embed(batch)
        cos, sin = self.mrope_cos_sin(batch.position_ids, h.dtype)
        meta = batch.attention_layout
        if meta is None:
            meta = make_varlen_meta(batch.cu_seqlens, causal=True, backend=self.attn_backend, segments=batch.segments)
        for layer in self.layers.values():
            h = layer(h, cos, sin, meta)
        h = self.norm(h)
        if targets is None:
            return ModelOutput(hidden=h)
        if self.value_head is not None:  # (no targets still runs the head: every rank's backward reaches it)
            return ModelOutput(hidden=h, values=self.value_head(h[targets.positions]).squeeze(-1).float())
        logp, ent = self.token_logprobs(
            h, targets.token_ids, targets.positions, temperature=targets.temperature,
            return_entropy=targets.return_entropy,
        )
        return ModelOutput(hidden=h, logprobs=logp, entropy=ent)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits (unsharded models only; used by parity tests and generation)."""
        return self.output(hidden)

    def token_logprobs(
        self,
        hidden: torch.Tensor,
        target_ids: torch.Tensor,
        positions: torch.Tensor,
        *,
        temperature: float = 1.0,
        chunk_size: int = 4096,
        return_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-prob of ``target_ids[i]`` predicted from ``hidden[positions[i]]`` (the token
        before it). Chunked so the vocab projection of a long rollout stays bounded."""
        logps, ents = [], []
        weight = self.output.weight
        # No targets still runs one (empty) chunk: the result stays connected to the output
        # projection and the hidden states, so a backward from it reaches every parameter and
        # every collective of the forward, like any other rank's (FSDP, sequence parallelism).
        for s in range(0, max(positions.numel(), 1), chunk_size):
            logits = F.linear(hidden[positions[s : s + chunk_size]], weight).float()
            if temperature != 1.0:
                logits = logits / temperature
            logp = torch.log_softmax(logits, dim=-1)
            logps.append(logp.gather(-1, target_ids[s : s + chunk_size, None]).squeeze(-1))
            if return_entropy:
                ents.append(-(logp.exp() * logp).sum(-1))
        return torch.cat(logps), (torch.cat(ents) if return_entropy else None)
