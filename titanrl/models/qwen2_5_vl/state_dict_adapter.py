"""HF Qwen2.5-VL safetensors <-> titanrl parameter names.

On-disk names are those of the released checkpoints (Qwen2.5-VL-7B, MiMo-VL-7B):
``visual.*``, ``model.layers.*``, ``model.embed_tokens.weight``, ``model.norm.weight``,
``lm_head.weight``. Checkpoints written by transformers >= 4.52 use
``model.visual.*`` / ``model.language_model.*``; both load. Saving always writes the
original names, which transformers and vLLM both read.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from titanrl.models.qwen2_5_vl.args import Qwen2_5_VLArgs

# (HF regex, titanrl template); {i} is the block/layer index.
_NAME_MAP: list[tuple[str, str]] = [
    (r"visual\.patch_embed\.proj\.weight", "vision.patch_embed.weight"),
    (r"visual\.blocks\.(\d+)\.norm1\.weight", "vision.blocks.{i}.norm1.weight"),
    (r"visual\.blocks\.(\d+)\.norm2\.weight", "vision.blocks.{i}.norm2.weight"),
    (r"visual\.blocks\.(\d+)\.attn\.qkv\.(weight|bias)", "vision.blocks.{i}.attn.qkv.{p}"),
    (r"visual\.blocks\.(\d+)\.attn\.proj\.(weight|bias)", "vision.blocks.{i}.attn.proj.{p}"),
    (r"visual\.blocks\.(\d+)\.mlp\.gate_proj\.(weight|bias)", "vision.blocks.{i}.mlp.w1.{p}"),
    (r"visual\.blocks\.(\d+)\.mlp\.up_proj\.(weight|bias)", "vision.blocks.{i}.mlp.w3.{p}"),
    (r"visual\.blocks\.(\d+)\.mlp\.down_proj\.(weight|bias)", "vision.blocks.{i}.mlp.w2.{p}"),
    (r"visual\.merger\.ln_q\.weight", "vision.merger.norm.weight"),
    (r"visual\.merger\.mlp\.0\.(weight|bias)", "vision.merger.fc1.{p}"),
    (r"visual\.merger\.mlp\.2\.(weight|bias)", "vision.merger.fc2.{p}"),
    (r"model\.embed_tokens\.weight", "tok_embeddings.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)", "layers.{i}.attention.wq.{p}"),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.(weight|bias)", "layers.{i}.attention.wk.{p}"),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.(weight|bias)", "layers.{i}.attention.wv.{p}"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.(weight)", "layers.{i}.attention.wo.{p}"),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.(weight)", "layers.{i}.feed_forward.w1.{p}"),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.(weight)", "layers.{i}.feed_forward.w3.{p}"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.(weight)", "layers.{i}.feed_forward.w2.{p}"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", "layers.{i}.attention_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "layers.{i}.ffn_norm.weight"),
    (r"model\.norm\.weight", "norm.weight"),
    (r"lm_head\.weight", "output.weight"),
]
_FROM_HF = [(re.compile(rf"^{pat}$"), tmpl) for pat, tmpl in _NAME_MAP]


def _template_to_regex(tmpl: str) -> re.Pattern[str]:
    body = re.escape(tmpl).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{p\}", r"(?P<p>weight|bias)")
    return re.compile(rf"^{body}$")


def _hf_pattern_to_template(pat: str) -> str:
    """Turn the HF regex back into a format string with {i} / {p} holes."""
    out = pat.replace(r"(\d+)", "{i}").replace("(weight|bias)", "{p}").replace("(weight)", "{p}")
    return out.replace("\\.", ".")


_TO_HF = [(_template_to_regex(tmpl), _hf_pattern_to_template(pat)) for pat, tmpl in _NAME_MAP]

# transformers >= 4.52 writes these prefixes; map them to the original ones before matching.
_NEW_HF_PREFIXES = [("model.visual.", "visual."), ("model.language_model.", "model.")]


def canonical_hf_name(name: str) -> str:
    for new, old in _NEW_HF_PREFIXES:
        if name.startswith(new):
            return old + name[len(new) :]
    return name


class Qwen2_5_VLStateDictAdapter(StateDictAdapter):
    def __init__(self, model_args: Qwen2_5_VLArgs, hf_assets_path: str | None = None) -> None:
        super().__init__(model_args, hf_assets_path)  # type: ignore[arg-type]
        self.args = model_args

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        v = self.args.vision
        out: dict[str, Any] = {}
        unknown: list[str] = []
        for raw_name, tensor in hf_state_dict.items():
            name = canonical_hf_name(raw_name)
            for regex, tmpl in _FROM_HF:
                m = regex.match(name)
                if m is None:
                    continue
                groups = m.groups()
                i = groups[0] if "{i}" in tmpl else None
                p = groups[-1] if "{p}" in tmpl else None
                ours = tmpl.format(i=i, p=p)
                if ours == "vision.patch_embed.weight":
                    # Conv3d [E, C, T, P, P] -> Linear [E, C*T*P*P]; same flattening as the processor.
                    tensor = tensor.reshape(v.hidden_size, -1)
                out[ours] = tensor
                break
            else:
                unknown.append(raw_name)
        if unknown:
            raise KeyError(f"HF checkpoint has tensors with no titanrl counterpart: {unknown[:10]}")
        if self.args.text.tie_word_embeddings and "output.weight" not in out and "tok_embeddings.weight" in out:
            out["output.weight"] = out["tok_embeddings.weight"]
        return out

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        v = self.args.vision
        out: dict[str, Any] = {}
        for name, tensor in state_dict.items():
            if name == "vision.patch_embed.weight":
                tensor = tensor.reshape(v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
            out[hf_name(name)] = tensor
        if self.args.text.tie_word_embeddings:
            out.pop("lm_head.weight", None)
        return out


def read_hf_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF model directory (single file or sharded with an index)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(path / f)))
    return tensors


def hf_name(name: str) -> str:
    """The on-disk (original-prefix) HF name of a titanrl parameter."""
    for regex, hf_tmpl in _TO_HF:
        m = regex.match(name)
        if m is not None:
            d = m.groupdict()
            return hf_tmpl.format(i=d.get("i"), p=d.get("p"))
    raise KeyError(f"titanrl parameter {name!r} has no HF name")


def hf_tensor_index(path: str | Path) -> dict[str, tuple[str, Path]]:
    """canonical HF name -> (name in the file, safetensors file) of a model directory; reads headers only."""
    from safetensors import safe_open

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {canonical_hf_name(k): (k, path / f) for k, f in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            out.update({canonical_hf_name(k): (k, f) for k in handle.keys()})
    return out


_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.")


def clean_name(name: str) -> str:
    """A parameter's name without the module wrappers torch.compile / activation checkpointing add."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def local_box(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]:
    """(global offset, local shape, local tensor) of a parameter: its own shard when it is a DTensor."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if isinstance(param, DTensor):
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        return tuple(offset), tuple(shape), param.to_local()
    return (0,) * param.dim(), tuple(param.shape), param


def load_hf_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Fill a titanrl model's parameters from an HF Qwen2.5-VL checkpoint, strictly, each from the bytes of its
    own shard: a model parallelised with FSDP2 (DTensor parameters, e.g. built on the meta device and then
    ``to_empty``) reads only this rank's rows of every tensor (safetensors slices of the memory-mapped files), a
    plain model reads everything. A critic (a model with a ``value_head``) takes everything but the vocabulary
    projection from a policy checkpoint, and its value head from the checkpoint when it has one
    (``value_head.*``, a saved critic), else zeros (every value 0 at first)."""
    from safetensors import safe_open

    from titanrl.models.lora import is_adapter

    args = model.args  # type: ignore[attr-defined]
    on_disk = hf_tensor_index(path)
    critic = getattr(model, "value_head", None) is not None
    # a tied output.weight is listed once; LoRA adapters (titanrl.models.lora) are not the base checkpoint's
    params = {clean_name(n): p for n, p in model.named_parameters() if not is_adapter(n)}
    expected = set(params)
    wanted: dict[str, tuple[str, Path] | None] = {}
    for name in expected:
        if name.startswith("value_head."):
            wanted[name] = on_disk.get(name)  # None: zeros
            continue
        key = hf_name(name)
        if key not in on_disk and name == "output.weight" and args.text.tie_word_embeddings:
            key = "model.embed_tokens.weight"
        wanted[name] = on_disk.get(key)
    missing = sorted(n for n, src in wanted.items() if src is None and not n.startswith("value_head."))
    used = {canonical_hf_name(src[0]) for src in wanted.values() if src is not None}
    ignored = {"lm_head.weight"} if critic or args.text.tie_word_embeddings else set()
    unexpected = sorted(set(on_disk) - used - ignored)
    if missing or unexpected:
        raise KeyError(f"checkpoint {path} does not match the model: missing {missing[:10]}, unexpected {unexpected[:10]}")
    handles: dict[Path, Any] = {}
    try:
        with torch.no_grad():
            for name, param in params.items():
                offset, shape, local = local_box(param)
                src = wanted[name]
                if src is None:  # a new critic's value head
                    local.zero_()
                    continue
                file_key, file = src
                if file not in handles:
                    handles[file] = safe_open(str(file), framework="pt")
                piece = handles[file].get_slice(file_key)
                full = tuple(piece.get_shape())
                if name == "vision.patch_embed.weight":  # Conv3d [E, C, T, P, P] -> Linear [E, C*T*P*P]
                    full = (full[0], math.prod(full[1:]))
                if full != tuple(param.shape):
                    raise ValueError(f"checkpoint {path}: {name} has shape {full}, model expects {tuple(param.shape)}")
                rows = slice(offset[0], offset[0] + shape[0]) if shape else slice(None)
                tensor = piece[rows] if shape else piece[:]
                if name == "vision.patch_embed.weight":
                    tensor = tensor.reshape(shape[0], -1)
                if len(shape) > 1:  # a shard along another dim too
                    tensor = tensor[(slice(None),) + tuple(slice(o, o + n) for o, n in zip(offset[1:], shape[1:]))]
                local.copy_(tensor.to(local.dtype))
    finally:
        handles.clear()


_ASSET_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "vocab.json",
    "merges.txt",
)


class HFShardWriter:
    """Writes an HF weight directory tensor by tensor, holding at most ``shard_bytes`` (plus the tensor
    being added) in memory: full shards become ``model-NNNNN.safetensors`` files with a
    ``model.safetensors.index.json`` (transformers' and vLLM's sharded layout); a model that fits one
    shard is a single ``model.safetensors``."""

    def __init__(self, outdir: str | Path, args: Qwen2_5_VLArgs, *, dtype: torch.dtype | None = None,
                 shard_bytes: int = 1 << 30) -> None:
        self.outdir = Path(outdir)
        self.outdir.mkdir(parents=True, exist_ok=True)
        for stale in [*self.outdir.glob("model*.safetensors"), self.outdir / "model.safetensors.index.json"]:
            stale.unlink(missing_ok=True)  # an earlier export's shards must not mix with this one's
        self.adapter = Qwen2_5_VLStateDictAdapter(args)
        self.args, self.dtype, self.shard_bytes = args, dtype, shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.weight_map: dict[str, str] = {}
        self.files: list[str] = []
        self.bytes_written = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """One titanrl-named tensor; it is converted (HF name, dtype, CPU) and may end a shard."""
        for hf_name, t in self.adapter.to_hf({name: tensor}).items():
            if self.dtype is not None and t.is_floating_point():
                t = t.to(self.dtype)
            t = t.detach().contiguous().cpu()
            self.pending[hf_name] = t
            self.pending_bytes += t.numel() * t.element_size()
        if self.pending_bytes >= self.shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        name = f"model-{len(self.files) + 1:05d}.safetensors"
        save_file(self.pending, str(self.outdir / name), metadata={"format": "pt"})
        self.weight_map.update({k: name for k in self.pending})
        self.files.append(name)
        self.bytes_written += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0

    def close(self, assets_from: str | Path | None = None) -> Path:
        self._flush()
        if len(self.files) == 1:
            (self.outdir / self.files[0]).rename(self.outdir / "model.safetensors")
            self.files = ["model.safetensors"]
        elif self.files:
            index = {"metadata": {"total_size": self.bytes_written}, "weight_map": dict(sorted(self.weight_map.items()))}
            (self.outdir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        if assets_from is not None:
            for name in _ASSET_FILES:
                src = Path(assets_from) / name
                if src.is_file() and src.resolve() != (self.outdir / name).resolve():
                    shutil.copy2(src, self.outdir / name)
        elif self.args.hf_config:
            (self.outdir / "config.json").write_text(json.dumps(self.args.hf_config, indent=2))
        return self.outdir


def save_hf_checkpoint(
    state_dict: dict[str, torch.Tensor],
    args: Qwen2_5_VLArgs,
    outdir: str | Path,
    *,
    assets_from: str | Path | None = None,
    dtype: torch.dtype | None = None,
    shard_bytes: int = 1 << 30,
) -> Path:
    """Write an HF directory (weights under original names + config/tokenizer/processor files
    copied from ``assets_from``) that transformers and vLLM load."""
    writer = HFShardWriter(outdir, args, dtype=dtype, shard_bytes=shard_bytes)
    for name, tensor in state_dict.items():
        writer.add(name, tensor)
    return writer.close(assets_from)
