"""titanrl's vLLM plugin (entry point ``vllm.general_plugins``): vLLM loads it in each of its processes (the
caller's, an engine core, every worker) before any model loads.

With ``TITANRL_VLLM_KEEP_WEIGHTS=1`` in the environment (``VLLM_ENV``: every titanrl engine, and the child
processes it spawns inherit it) a CPU engine's linear layers keep their weights and compute with torch's linear,
instead of vLLM-CPU's oneDNN kernels, which pack each weight into a kernel-specific copy and drop the original.
Kept weights are what the weight push writes into in place (``model.load_weights``, as on CUDA, where vLLM never
drops them); packed ones can only be replaced by vLLM's layer-wise reload, which rebuilds every layer's kernel
on every push (~2.5x the push on the tiny model, ``benchmarks/weight_sync.md``). Nothing changes on CUDA.
Where vLLM packs all the same (its AMX bf16 / zentorch paths take no notice of this switch) the engine sees the
weights gone and pushes through the reload (``titanrl.rollout.vllm_engine``).

Set ``TITANRL_VLLM_KEEP_WEIGHTS=0`` to keep vLLM-CPU's own kernels. Without the plugin (``VLLM_PLUGINS`` set
without ``titanrl``, or titanrl not installed as a package) vLLM packs, and the push reloads.
"""

from __future__ import annotations

import os

KEEP_WEIGHTS_ENV = "TITANRL_VLLM_KEEP_WEIGHTS"


def register() -> None:
    if os.environ.get(KEEP_WEIGHTS_ENV) != "1":
        return
    try:
        from vllm import _custom_ops
    except ImportError:  # a vLLM without its compiled ops: nothing packs
        return
    # read by vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm when a layer's weights are processed:
    # False takes its fallback, torch.nn.functional.linear on the layer's own weight
    _custom_ops._supports_onednn = False
