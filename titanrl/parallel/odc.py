"""One synchronisation per minibatch on PyTorch's own FSDP2 (the ODC idea, ODC paper sec. 3-4).

Usual FSDP all-gathers every layer's parameters before each microbatch's forward (and again in
backward) and reduce-scatters its gradients after each backward: every rank waits for the slowest at
every layer of every microbatch, and all ranks must run the same number of microbatches.
:func:`minibatch_sync` instead, with FSDP2's public controls only:

- at the start, every FSDP module is all-gathered once (``unshard``, in module order on every rank)
  and told to keep its parameters (``set_reshard_after_forward(False)``,
  ``set_reshard_after_backward(False)``), so no microbatch issues a parameter collective;
- gradients accumulate locally, unreduced (``set_requires_gradient_sync(False)``), until the rank's
  *last* microbatch, whose backward reduce-scatters them (``last()`` turns the sync on): one
  reduction per parameter shard group per minibatch, whatever the microbatch counts;
- at the end every module is resharded and the settings restored.

Ranks can therefore run different numbers of microbatches. The cost (say so to users): full
parameters and unsharded gradients stay resident for the whole minibatch (``lb_mini``).
:func:`odc_sync` (``odc``) keeps FSDP's memory instead: units gather from the owners' shared memory when
they run and scatter-accumulate their gradients into the owners' buffers (``titanrl.parallel.odc_comm``).
Collectives of other kinds inside a microbatch (Ulysses all-to-alls) must all be issued before any rank's last microbatch:
the stage plan runs sharded groups first and puts each rank's whole sequences last.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    """Every FSDP unit of ``model``, in module order (the same on every rank)."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def reshard_root_after(model: nn.Module) -> Iterator[Callable[[], None]]:
    """A stage of forwards without backward (log-probs, values) under per-microbatch sync: FSDP2 keeps the root
    module's parameters gathered after each forward (the backward that follows would gather them again at
    once), and with no backward they stayed gathered into the next stage, a full copy of the embedding and the
    output head (2.2 GB in bf16 at 7B). Reshard the root on exit. Yields a no-op ``last()`` like
    ``minibatch_sync``; without FSDP nothing happens."""
    try:
        yield lambda: None
    finally:
        if isinstance(model, FSDPModule):
            model.reshard()


@contextmanager
def minibatch_sync(model: nn.Module, *, train: bool, reshard_after_forward: bool = True
                   ) -> Iterator[Callable[[], None]]:
    """Run a minibatch with parameters gathered once and gradients reduced once (module docstring).
    Yields ``last()``: call it before the rank's last microbatch (``train``); without FSDP (one
    process) everything is a no-op. ``reshard_after_forward`` is the model's setting to restore."""
    modules = fsdp_modules(model)
    if not modules:
        yield lambda: None
        return
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
        m.set_reshard_after_backward(False, recurse=False)
        if train:
            m.set_requires_gradient_sync(False, recurse=False)
    for m in modules:
        m.unshard()

    def last() -> None:
        for m in modules:
            m.set_requires_gradient_sync(True, recurse=False)

    try:
        yield last
    finally:
        for m in modules:
            m.reshard()
            # FSDP keeps the root's parameters after forward (they are needed at once in backward)
            m.set_reshard_after_forward(reshard_after_forward and m is not model, recurse=False)
            m.set_reshard_after_backward(True, recurse=False)
            m.set_requires_gradient_sync(True, recurse=False)


@contextmanager
def odc_sync(model: nn.Module, *, train: bool) -> Iterator[Callable[[], None]]:
    """A stage under ``balance.strategy = "odc"``: FSDP's per-unit gathers and frees, served from the owners'
    shared memory, gradients scatter-accumulated into the owners' buffers, one barrier at the end of a train
    stage (``titanrl.parallel.odc_comm``). Yields a no-op ``last()`` (nothing is reduced in the last
    microbatch); without FSDP everything is a no-op. An exception in the stage skips the barrier (the rank
    leaves; the others stop at theirs)."""
    from titanrl.parallel.odc_comm import odc_comm

    comm = odc_comm(model)
    if comm is None:
        yield lambda: None
        return
    comm.enter(train=train)
    yield lambda: None
    for m in fsdp_modules(model):
        m.reshard()
    comm.exit()
    if train:
        comm.finish_train()


def forward_scope(model: nn.Module):
    """A forward outside the stage runner (the engine probe), run by every rank of the model: under ``odc`` a
    forward-only stage (the owners' publications refreshed); otherwise nothing."""
    from titanrl.parallel.odc_comm import attached

    return odc_sync(model, train=False) if attached(model) is not None else nullcontext()
