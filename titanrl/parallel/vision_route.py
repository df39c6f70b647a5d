"""The distributed edge of vision balancing: moves vision-tower output rows from the rank that
encoded them to the ranks whose placeholder tokens use them, with one autograd all-to-all (the
gradient of every row goes back to its encoder the same way).

The model calls the route between the vision tower and the placeholder scatter
(``PackedBatch.vision_route``); it knows nothing else about it. The indices come from
:func:`titanrl.parallel.vision_plan.route_indices`.
"""

from __future__ import annotations

import torch
from torch.distributed._functional_collectives import all_to_all_single_autograd

from titanrl.parallel.vision_plan import RouteIndices


# Plain classes, not dataclasses: FSDP2 rebuilds dataclass forward arguments (PackedBatch holds the
# route), and a rebuilt counter would count into a copy.
class RouteCounter:
    """Bytes of embedding rows (and their gradients) that crossed ranks on this rank's sends."""

    def __init__(self) -> None:
        self.forward_bytes = 0
        self.backward_bytes = 0


class VisionRoute:
    def __init__(self, indices: RouteIndices, rank: int, group: object, *, collective: bool,
                 counter: RouteCounter | None = None) -> None:
        self.indices = indices
        self.rank = rank
        self.group = group  # every rank, a dedicated group (built once at start-up)
        self.collective = collective  # False: no row crosses ranks in this wave (every rank agrees)
        self.counter = counter or RouteCounter()

    def __call__(self, encoded: torch.Tensor) -> torch.Tensor:
        """``encoded``: this rank's vision-tower output rows (possibly none) -> the rows its
        placeholder tokens need, in need order."""
        idx = self.indices
        send = encoded.index_select(0, torch.as_tensor(idx.send_index, device=encoded.device))
        if not self.collective:
            return send.index_select(0, torch.as_tensor(idx.recv_order, device=encoded.device))
        row_bytes = encoded.shape[-1] * encoded.element_size()
        crossing_out = sum(idx.send_counts) - idx.send_counts[self.rank]
        crossing_in = sum(idx.recv_counts) - idx.recv_counts[self.rank]
        self.counter.forward_bytes += crossing_out * row_bytes
        recv = all_to_all_single_autograd(send.contiguous(), list(idx.recv_counts), list(idx.send_counts), self.group)
        if recv.requires_grad:
            def count(_grad, n=crossing_in * row_bytes):
                self.counter.backward_bytes += n

            recv.register_hook(count)
        # index_select materialises the collective's result (an un-waited tensor must not flow on)
        return recv.index_select(0, torch.as_tensor(idx.recv_order, device=encoded.device))
