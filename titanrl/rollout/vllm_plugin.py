"""titanrl's vLLM plugin (entry point ``vllm.general_plugins``): vLLM loads it in each of its processes (the
caller's, an engine core, every worker) before any model loads.

With ``TITANRL_VLLM_KEEP_WEIGHTS=1`` in the environment (``VLLM_ENV``: every titanrl engine, and the child
processes it spawns inherit it) a CPU engine's linear layers keep their weights beside the kernels vLLM-CPU packs
from them (its oneDNN / AMX / zentorch GEMMs: a kernel-specific copy, after which vLLM drops the original). Kept
weights are what the weight push writes into in place (the model's ``load_weights``, as on CUDA, where vLLM never
drops them); the push then packs each layer's kernel again from its new weight (``repack_cpu_kernels``), with the
same function vLLM packed it with at load, so generation computes exactly as vLLM-CPU's own. Without kept weights
only vLLM's layer-wise reload can replace them, which rebuilds every layer on every push (~2.5x the push on the
tiny model, ``benchmarks/weight_sync.md``). The price: the linear weights are held twice on a CPU engine. Nothing
changes on CUDA.

Set ``TITANRL_VLLM_KEEP_WEIGHTS=0`` to keep vLLM-CPU's own behaviour. Without the plugin (``VLLM_PLUGINS`` set
without ``titanrl``, or titanrl not installed as a package) vLLM drops the weights; the engine sees them gone and
pushes through the reload (``titanrl.rollout.vllm_engine``).
"""

from __future__ import annotations

import os
from typing import Any

KEEP_WEIGHTS_ENV = "TITANRL_VLLM_KEEP_WEIGHTS"


def register() -> None:
    if os.environ.get(KEEP_WEIGHTS_ENV) != "1":
        return
    try:
        from vllm.model_executor.layers import utils
    except ImportError:
        return
    dispatch = utils.dispatch_cpu_unquantized_gemm
    if getattr(dispatch, "__wrapped__", None) is not None:  # already (plugins may load more than once)
        return

    def keep_weight(layer: Any, remove_weight: bool) -> None:
        """vLLM-CPU's GEMM dispatch (read at call time by the linear and embedding layers' weight processing),
        the layer's weight kept."""
        dispatch(layer, remove_weight=False)

    keep_weight.__wrapped__ = dispatch
    utils.dispatch_cpu_unquantized_gemm = keep_weight


def cpu_gemm_layers(model: Any) -> list:
    """The layers of ``model`` whose 2-D weight vLLM-CPU's GEMM dispatch gave a packed kernel (a ``cpu_linear``; none
    on CUDA), vLLM's plain-linear exceptions left out."""
    return [m for m in model.modules()
            if callable(getattr(m, "cpu_linear", None)) and getattr(getattr(m, "weight", None), "ndim", 0) == 2
            and not getattr(m, "_cpu_skip_gemm_dispatch", False)]


def repack_cpu_kernels(model: Any, loaded: Any = None) -> int:
    """The CPU GEMM kernels of ``model`` (the layers vLLM-CPU's dispatch gave a ``cpu_linear``) whose weight is among
    the parameters named ``loaded`` (what ``model.load_weights`` returns; None: every one) packed again from that
    weight, as vLLM packed it at load; their number (0 on CUDA, where no layer has one). A weight shared by two layers
    (a tied output head) repacks both."""
    keep = None if loaded is None else {id(p) for n, p in model.named_parameters(remove_duplicate=False) if n in loaded}
    layers = [m for m in cpu_gemm_layers(model) if keep is None or id(m.weight) in keep]
    if not layers:
        return 0
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch = getattr(dispatch_cpu_unquantized_gemm, "__wrapped__", dispatch_cpu_unquantized_gemm)
    for layer in layers:
        dispatch(layer, remove_weight=False)
    return len(layers)
