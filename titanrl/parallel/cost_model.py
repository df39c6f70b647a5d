"""Cost model shared by the FlexUlysses shard planner and the ODC-style minibatch partitioners.

One object, not constants, so a run can swap in coefficients fitted from its own step timings
(:meth:`CostModel.fit`). Every term is per device and is what a balancing decision trades:

- **attention** ``attention_coef * h**2``: causal self-attention over a sequence of ``h`` tokens.
  Under Ulysses each of the ``p`` ranks of the group computes full-length attention for ``1/p`` of
  the heads, so a sequence sharded ``p`` ways costs ``attention(h) / p`` on every member.
- **linear** ``linear_coef * h``: the token-parallel parts (QKV/O projections, MLP, LM head).
  Ulysses gives every member ``h/p`` tokens, so ``linear(h) / p`` on each.
- **vision tower** ``vision_linear_coef * n + vision_attention_coef * n**2`` for one image or one
  temporal frame slice of ``n`` patches (Qwen2.5-VL's full-attention layers attend within one
  image/frame slice; its windowed layers are linear in ``n`` and folded into the linear term).
- **all-to-all** ``h (p-1) / p**2`` tokens sent per device per all-to-all (the SeqAlltoAll volume
  of FlexRL appendix A), converted to seconds with the intra- or inter-node bandwidth.
- **SplitCost** the paper's communication proxy used to break ties in the placement heuristic:
  ``0`` for ``p <= 1``, ``h (p-1)/p**2`` up to ``tau`` and ``gamma`` times that beyond ``tau``.

Default coefficients (documented in docs/planner.md) are FLOPs of one forward+backward pass
(3x forward) of the MiMo-VL-7B / Qwen2.5-VL-7B shape the FlexRL paper trains:

- LLM: 28 layers, hidden 3584, 28 query / 4 KV heads of 128, MLP 18944, vocabulary 152064.
  Linear params per token ~ 6.53e9 (layers) + 0.545e9 (LM head); forward linear FLOPs are
  ``2 * params`` per token. Causal attention forward is ``2 * layers * hidden * h**2``
  (QK^T and PV, halved by the causal mask). Attention overtakes linear at h ~ 70k tokens.
- ViT: 32 layers of hidden 1280 (SwiGLU MLP 3420) ~ 0.63e9 params per patch plus the 2x2
  merger per 4 patches; 28 windowed layers (64-patch windows, linear in n) and 4 full layers.
- Throughput ``flops_per_second`` 4e14 (an H800's ~990 TFLOP/s bf16 at 40% MFU) converts FLOPs
  to seconds; it only matters when comparing compute with communication.
- All-to-all bytes per token: per layer, forward sends Q, K, V and the output (bf16; K/V at the
  4 KV heads), backward the same again: ``2 bytes * 2 * (2*3584 + 2*512) * 28``.
- Bandwidths per GPU: 400 GB/s NVLink inside a node of 8, 25 GB/s across nodes (1600 Gb/s RoCE
  per 8-GPU node), the FlexRL paper's H800 cluster.

``CostModel.attention_only()`` is the paper's planning proxy (compute load ``h**2/p``, no linear or
vision term); ``plan_shards(cost_model=None)`` uses it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import numpy as np

ArrayLike = float | int | np.ndarray | Sequence[float] | Sequence[int]

_TRAIN_FACTOR = 3.0  # forward + backward = 3x forward FLOPs
_LLM_LAYERS, _LLM_HIDDEN, _LLM_KV_DIM = 28, 3584, 4 * 128
_LLM_LINEAR_PARAMS = 6.53e9 + 0.545e9  # decoder layers + LM head
_VIT_LINEAR_PARAMS_PER_PATCH = 0.63e9 + 44.6e6 / 4  # 32 blocks + the 2x2 patch merger
_VIT_WINDOW_PATCHES, _VIT_WINDOW_LAYERS, _VIT_FULL_LAYERS, _VIT_HIDDEN = 64, 28, 4, 1280


@dataclass(frozen=True)
class CostModel:
    """Per-device cost terms; see the module docstring for the defaults' derivation.

    Compute terms are in ``units`` (FLOPs by default); :meth:`seconds` converts them with
    ``flops_per_second``. A fitted model (:meth:`fit`) is in seconds with ``flops_per_second=1``.
    """

    attention_coef: float = _TRAIN_FACTOR * 2 * _LLM_LAYERS * _LLM_HIDDEN
    linear_coef: float = _TRAIN_FACTOR * 2 * _LLM_LINEAR_PARAMS
    vision_linear_coef: float = _TRAIN_FACTOR * (
        2 * _VIT_LINEAR_PARAMS_PER_PATCH + 4 * _VIT_WINDOW_PATCHES * _VIT_HIDDEN * _VIT_WINDOW_LAYERS
    )
    vision_attention_coef: float = _TRAIN_FACTOR * 4 * _VIT_HIDDEN * _VIT_FULL_LAYERS
    flops_per_second: float = 4e14
    alltoall_bytes_per_token: float = 2 * 2 * (2 * _LLM_HIDDEN + 2 * _LLM_KV_DIM) * _LLM_LAYERS
    intra_node_bandwidth: float = 400e9  # bytes/s per GPU
    inter_node_bandwidth: float = 25e9  # bytes/s per GPU
    gpus_per_node: int = 8
    split_tau: int = 8
    split_gamma: float = 16.0
    units: str = "flops"

    def __post_init__(self) -> None:
        for field in ("attention_coef", "linear_coef", "vision_linear_coef", "vision_attention_coef"):
            if getattr(self, field) < 0:
                raise ValueError(f"{field} must be >= 0, got {getattr(self, field)}")
        if self.attention_coef == 0 and self.linear_coef == 0:
            raise ValueError("attention_coef and linear_coef cannot both be 0")
        for field in ("flops_per_second", "intra_node_bandwidth", "inter_node_bandwidth"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be > 0, got {getattr(self, field)}")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")

    # ------------------------------------------------------------------ constructors

    @classmethod
    def attention_only(cls) -> "CostModel":
        """The FlexRL appendix-A proxy: compute load ``h**2 / p`` only."""
        return cls(attention_coef=1.0, linear_coef=0.0, vision_linear_coef=0.0, vision_attention_coef=0.0,
                   flops_per_second=1.0, units="h^2")

    @classmethod
    def verl_workload(cls) -> "CostModel":
        """verl's balancing workload ``24576 * s + s**2`` (text tokens only, no vision term)."""
        return cls(attention_coef=1.0, linear_coef=24576.0, vision_linear_coef=0.0, vision_attention_coef=0.0,
                   flops_per_second=1.0, units="verl")

    @classmethod
    def for_shape(cls, *, layers: int, hidden: int, q_dim: int, kv_dim: int, intermediate: int, head_out: int,
                  vision_depth: int = 0, vision_hidden: int = 0, vision_intermediate: int = 0,
                  vision_full_layers: int = 0) -> "CostModel":
        """The forward + backward FLOPs of a decoder of this shape (``head_out``: the output head's columns, the
        vocabulary or 1 for a value head) and of its vision tower (``vision_depth`` blocks, ``vision_full_layers``
        of them attending over a whole image): per layer the q / k / v / o projections ``h (2 q + 2 kv)`` and the
        SwiGLU MLP ``3 h I`` multiply-adds per token, causal attention ``2 q_dim`` per pair of tokens (QK^T and PV
        over h^2 / 2 pairs). What the balancers (``balance.cost_model = "flops"``) and the HetRL scheduler price."""
        per_layer = hidden * (2 * q_dim + 2 * kv_dim) + 3 * hidden * intermediate
        vit_per_patch = vision_depth * (4 * vision_hidden**2 + 3 * vision_hidden * vision_intermediate)
        return cls(
            attention_coef=_TRAIN_FACTOR * 2 * layers * q_dim,
            linear_coef=_TRAIN_FACTOR * 2 * (layers * per_layer + hidden * head_out),
            vision_linear_coef=_TRAIN_FACTOR * 2 * vit_per_patch,
            vision_attention_coef=_TRAIN_FACTOR * 4 * vision_hidden * vision_full_layers,
        )

    @classmethod
    def for_model(cls, args, *, value_head: bool = False) -> "CostModel":
        """:meth:`for_shape` of a Qwen2.5-VL shape (``titanrl.models.qwen2_5_vl.args.Qwen2_5_VLArgs``); with
        ``value_head`` the output head is PPO's critic's (one column)."""
        t, v = args.text, args.vision
        return cls.for_shape(layers=t.num_hidden_layers, hidden=t.hidden_size,
                             q_dim=t.num_attention_heads * t.head_dim, kv_dim=t.num_key_value_heads * t.head_dim,
                             intermediate=t.intermediate_size, head_out=1 if value_head else t.vocab_size,
                             vision_depth=v.depth, vision_hidden=v.hidden_size,
                             vision_intermediate=v.intermediate_size,
                             vision_full_layers=len(v.fullatt_block_indexes))

    @property
    def forward_linear_per_token(self) -> float:
        """Forward FLOPs of one token's matmuls (the linear term over the train factor)."""
        return self.linear_coef / _TRAIN_FACTOR

    def forward_attention(self, h: float) -> float:
        """Forward FLOPs of causal attention over one sequence of ``h`` tokens."""
        return float(self.attention(h)) / _TRAIN_FACTOR

    def with_(self, **changes: float | int | str) -> "CostModel":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ compute terms

    def attention(self, h: ArrayLike) -> np.ndarray | float:
        x = np.asarray(h, dtype=np.float64)
        return self.attention_coef * x * x

    def linear(self, h: ArrayLike) -> np.ndarray | float:
        return self.linear_coef * np.asarray(h, dtype=np.float64)

    def compute(self, h: ArrayLike) -> np.ndarray | float:
        """LLM cost of whole sequences of ``h`` tokens (divide by ``p`` for one Ulysses shard)."""
        x = np.asarray(h, dtype=np.float64)
        return self.attention_coef * x * x + self.linear_coef * x

    def prefix_compute(self, prompt_len: int, response_lens: Sequence[int]) -> float:
        """LLM cost of a prompt computed once with responses that share it (shared-prefix packing):
        every token's linear layers once, the prompt's attention once, and each response's attention
        over the prompt and itself (``attention(P + r) - attention(P)``), none between siblings. With
        one response it is ``compute(P + r)``."""
        p = float(prompt_len)
        tokens = p + float(sum(response_lens))
        own = sum(float(self.attention(p + r)) - float(self.attention(p)) for r in response_lens)
        return float(self.linear(tokens)) + float(self.attention(p)) + own

    def vision(self, patches: ArrayLike) -> np.ndarray | float:
        """Vision-tower cost of images / frame slices of ``patches`` patches each."""
        n = np.asarray(patches, dtype=np.float64)
        return self.vision_linear_coef * n + self.vision_attention_coef * n * n

    def seconds(self, cost: ArrayLike) -> np.ndarray | float:
        return np.asarray(cost, dtype=np.float64) / self.flops_per_second

    # ------------------------------------------------------------------ communication terms

    @staticmethod
    def alltoall_volume(h: ArrayLike, p: ArrayLike) -> np.ndarray | float:
        """Tokens one device sends in one SeqAlltoAll for a sequence of ``h`` tokens on ``p`` ranks."""
        x = np.asarray(h, dtype=np.float64)
        q = np.asarray(p, dtype=np.float64)
        return x * (q - 1.0) / (q * q)

    def split_cost(self, h: ArrayLike, p: ArrayLike) -> np.ndarray | float:
        """FlexRL appendix A's SplitCost(h, p) (tau, gamma from the model)."""
        x = np.asarray(h, dtype=np.float64)
        q = np.asarray(p, dtype=np.float64)
        base = np.where(q <= 1, 0.0, x * (q - 1.0) / (q * q))
        return np.where(q > self.split_tau, self.split_gamma * base, base)

    def comm_cost(self, h: ArrayLike, p: ArrayLike) -> np.ndarray | float:
        """What the planner minimizes: ``p * SplitCost(h, p)``, the volume summed over the ``p``
        ranks of the group, ``h (p-1)/p`` (times ``gamma`` beyond ``tau``).

        The paper sums ``SplitCost`` itself over sequences; that is the traffic of *one* member,
        and it falls as ``p`` grows past 2 (h/4 at p=2, 3h/16 at p=4, 7h/64 at p=8), so minimizing
        it would favour more sharding. Weighting by the group size makes it the total volume, which
        grows with ``p`` as the all-to-all bytes do.
        """
        q = np.asarray(p, dtype=np.float64)
        return q * self.split_cost(h, p)

    def spans_nodes(self, ranks: Sequence[int]) -> bool:
        return len({r // self.gpus_per_node for r in ranks}) > 1

    def alltoall_seconds(self, h: float, ranks: Sequence[int]) -> float:
        """Seconds of the all-to-alls of one training step for a sequence of ``h`` tokens on ``ranks``."""
        p = len(ranks)
        if p <= 1:
            return 0.0
        bandwidth = self.inter_node_bandwidth if self.spans_nodes(ranks) else self.intra_node_bandwidth
        return float(self.alltoall_volume(h, p)) * self.alltoall_bytes_per_token / bandwidth

    # ------------------------------------------------------------------ calibration

    @classmethod
    def fit(
        cls,
        sum_h2: ArrayLike,
        sum_h: ArrayLike,
        seconds: ArrayLike,
        *,
        sum_patches: ArrayLike | None = None,
        base: "CostModel | None" = None,
    ) -> "CostModel":
        """Least-squares coefficients (in seconds) from measured per-device step timings.

        Each row is one device in one measured step: ``sum_h2 = sum h_i**2 / p_i`` and
        ``sum_h = sum h_i / p_i`` over the shards it held, optionally ``sum_patches`` (vision-tower
        patches it encoded), and the compute seconds measured on it. Coefficients are constrained
        to be non-negative (``scipy.optimize.nnls``). The vision
        attention term is not fitted (set to 0); communication settings are kept from ``base``.
        """
        columns = [np.asarray(sum_h2, dtype=np.float64), np.asarray(sum_h, dtype=np.float64)]
        if sum_patches is not None:
            columns.append(np.asarray(sum_patches, dtype=np.float64))
        y = np.asarray(seconds, dtype=np.float64)
        features = np.stack(columns, axis=1)
        if features.shape[0] != y.shape[0] or features.shape[0] < features.shape[1]:
            raise ValueError(f"need at least {features.shape[1]} rows of matching length, got {features.shape[0]}")
        from scipy.optimize import nnls  # the one non-negative least squares (hetero.cost.fit uses it too)

        scale = np.where(features.max(axis=0) > 0, features.max(axis=0), 1.0)  # h^2 and h columns differ by 1e3+
        coef = nnls(features / scale, y, maxiter=100)[0] / scale
        if coef[0] <= 0 and coef[1] <= 0:
            raise ValueError("the fit found no positive attention or linear coefficient")
        base = base or cls()
        return dataclasses.replace(
            base,
            attention_coef=float(coef[0]),
            linear_coef=float(coef[1]),
            vision_linear_coef=float(coef[2]) if sum_patches is not None else 0.0,
            vision_attention_coef=0.0,
            flops_per_second=1.0,
            units="seconds",
        )
