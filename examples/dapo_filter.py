"""The filter of DAPO's dynamic sampling as a workflow node: drop the prompt groups whose responses all scored the
same (DAPO then samples more prompts to refill the batch; this node does not: the step trains on fewer groups).

Their GRPO advantages are all 0, so they carry no policy gradient but still cost the log-prob and update
stages. Added to the built-in workflow by configs/examples/dapo_filter.toml (docs/workflow.md):

    [[workflow.nodes]]
    id = "drop_uniform"
    function = "examples/dapo_filter.py:drop_uniform_groups"
    inputs = ["reward"]

    [[workflow.nodes]]
    id = "advantage"          # the built-in node now reads the filtered batch
    inputs = ["drop_uniform"]

A prompt's responses are generated and scored on one rank, so the filter needs nothing from other ranks.
(DAPO also re-samples until the batch is full again; this node only drops.)
"""


import torch

from titanrl.distributed import all_reduce_sum


def drop_uniform_groups(batch, ctx):
    """Keep the groups whose rewards differ. A node's metrics go on the step line as the first of its ranks has
    them, so numbers that differ between ranks are summed over the node's ranks first (``batch.group``: every
    rank of the node's placement reaches this collective; placed where the reward runs, the rollout ranks)."""
    kept, dropped = [], 0
    for group in batch.groups().values():
        if len({t.reward for t in group}) > 1:
            kept += group
        else:
            dropped += 1
    out = batch.keep(lambda t: any(t is k for k in kept))
    totals = all_reduce_sum(torch.tensor([dropped, sum(t.num_tokens for t in kept)], dtype=torch.float64),
                            group=batch.group)
    out.metrics["dapo/dropped_groups"] = totals[0].item()
    out.metrics["dapo/kept_tokens"] = totals[1].item()
    return out
