"""Weight files for engine updates: read safetensors headers and check an update (the trainer writes them:
``titanrl.rl.weight_sync.WeightPusher``).

A vLLM reload that fails half-way leaves the engine dead, so every update is checked against the
names, shapes and dtypes of the checkpoint the engine was started from *before* the engine sees
it. Only headers are read (no tensor data), so the check costs milliseconds.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from titanrl.models.qwen2_5_vl.state_dict_adapter import canonical_hf_name
from titanrl.rollout.types import WeightsMismatchError

_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string: F32, BF16, ...

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n * _ITEMSIZE[self.dtype]


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def safetensors_dtype(dtype) -> str:
    """The safetensors code (F32, BF16, ...) of a torch dtype."""
    name = str(dtype).removeprefix("torch.")
    for code, torch_name in _SAFETENSORS_DTYPES.items():
        if torch_name == name:
            return code
    raise ValueError(f"no safetensors code for {dtype}")


def torch_dtype(code: str):
    """The torch dtype of a safetensors code."""
    import torch

    return getattr(torch, _SAFETENSORS_DTYPES[code])


def tensors_layout(tensors) -> dict[str, TensorInfo]:
    """HF name -> TensorInfo of in-memory (name, tensor) pairs."""
    return {name: TensorInfo(tuple(t.shape), safetensors_dtype(t.dtype)) for name, t in tensors}


def weight_files(hf_dir: str | Path) -> list[Path]:
    """The *.safetensors files of an HF model directory (sharded with an index, or not)."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise WeightsMismatchError(f"{hf_dir} is not a directory")
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [hf_dir / n for n in names]
    else:
        files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise WeightsMismatchError(f"no *.safetensors weights in {hf_dir}")
    return files


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor names -> shape/dtype of one safetensors file, checking the header is complete and
    the data section really holds every tensor (a truncated file is caught here)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise WeightsMismatchError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > size - 8 or header_len > 100_000_000:
            raise WeightsMismatchError(f"{path}: not a safetensors file (bad header length {header_len})")
        try:
            header = json.loads(f.read(header_len))
        except ValueError as e:
            raise WeightsMismatchError(f"{path}: unreadable safetensors header ({e})") from None
    data_len = size - 8 - header_len
    out: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        begin, end = meta["data_offsets"]
        if end > data_len:
            raise WeightsMismatchError(f"{path}: tensor {name} lies past the end of the file (truncated?)")
        out[name] = TensorInfo(tuple(int(d) for d in meta["shape"]), str(meta["dtype"]))
    return out


def read_headers(hf_dir: str | Path) -> dict[str, TensorInfo]:
    out: dict[str, TensorInfo] = {}
    for f in weight_files(hf_dir):
        out.update(read_header(f))
    return out


# vLLM's Qwen2.5-VL fuses these checkpoint modules into one (its ``packed_modules_mapping``).
QWEN2_5_VL_PACKED_MODULES: dict[str, list[str]] = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}


def engine_module(name: str, packed: Mapping[str, list[str]]) -> str:
    """The engine module a checkpoint tensor loads into: its parent module path, with fused
    projections (q/k/v, gate/up) mapped to the fused module."""
    module = canonical_hf_name(name).rpartition(".")[0]
    parent, _, leaf = module.rpartition(".")
    for fused, parts in packed.items():
        if leaf in parts:
            leaf = fused
            break
    return f"{parent}.{leaf}" if parent else leaf


def check_update(
    reference: Mapping[str, TensorInfo],
    update: Mapping[str, TensorInfo],
    *,
    where: str,
    packed: Mapping[str, list[str]] | None = None,
) -> None:
    """Every tensor of ``update`` must be a known weight (HF name, either prefix style) with the
    reference shape and a floating dtype. A partial update (a subset of names) is allowed only in
    whole engine modules (``packed``: the engine's fused modules): vLLM's layer-wise reload (the
    push into an engine that dropped its weights) rebuilds every module it touches from scratch, so
    a module given only in part (say v_proj without q_proj/k_proj, or a weight without its bias)
    would keep uninitialised memory there."""
    ref = {canonical_hf_name(k): v for k, v in reference.items()}
    if not update:
        raise WeightsMismatchError(f"{where}: the update holds no tensors")
    unknown = [k for k in update if canonical_hf_name(k) not in ref]
    bad_shape = [
        f"{k}: {list(v.shape)} (engine has {list(ref[canonical_hf_name(k)].shape)})"
        for k, v in update.items()
        if canonical_hf_name(k) in ref and v.shape != ref[canonical_hf_name(k)].shape
    ]
    bad_dtype = [f"{k}: {v.dtype}" for k, v in update.items() if v.dtype not in _FLOAT_DTYPES]
    split = []
    if packed is not None:
        given = {canonical_hf_name(k) for k in update}
        modules: dict[str, set[str]] = {}
        for k in ref:
            modules.setdefault(engine_module(k, packed), set()).add(k)
        for module in sorted({engine_module(k, packed) for k in given if k in ref}):
            missing = sorted(modules[module] - given)
            if missing:
                split.append(f"{module} (missing {missing})")
    problems = []
    if unknown:
        problems.append(f"{len(unknown)} unknown tensor name(s), e.g. {unknown[:5]}")
    if bad_shape:
        problems.append(f"{len(bad_shape)} shape mismatch(es): {bad_shape[:5]}")
    if bad_dtype:
        problems.append(f"{len(bad_dtype)} non-floating tensor(s): {bad_dtype[:5]}")
    if split:
        problems.append(
            f"{len(split)} engine module(s) given only in part (a partial update must hold every "
            f"tensor of each module it touches): {split[:5]}"
        )
    if problems:
        raise WeightsMismatchError(
            f"{where}: rejected weight update, nothing was loaded: " + "; ".join(problems)
        )


def checked_stream(tensors, layout: Mapping[str, TensorInfo]):
    """(name, tensor) pairs as they come, each checked against the ``layout`` the update declared (and checked with
    ``check_update`` before the first); a stream that ends early or carries another tensor is an error of the
    sender's."""
    seen = set()
    for name, tensor in tensors:
        info = layout.get(name)
        if info is None or tuple(tensor.shape) != tuple(info.shape) or safetensors_dtype(tensor.dtype) != info.dtype:
            raise WeightsMismatchError(f"weight stream: {name} {tuple(tensor.shape)} {tensor.dtype} is not what the "
                                       f"update declared ({info})")
        seen.add(name)
        yield name, tensor
    if len(seen) != len(layout):
        missing = sorted(set(layout) - seen)
        raise WeightsMismatchError(f"weight stream ended without {len(missing)} declared tensor(s), e.g. {missing[:5]}")


def file_tensors(files):
    """(name, tensor) of every tensor of the given safetensors files, one at a time."""
    from safetensors import safe_open

    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
