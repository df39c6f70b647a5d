"""A user node for the tests: the responses the engine cut at rollout.max_new_tokens dropped after their group's
advantages (the graph's own way to leave trajectories out of the later stages), against which rl.mask_truncated
is compared."""


def drop_truncated(batch, ctx):
    return batch.keep(lambda t: t.finish_reason != "length")
