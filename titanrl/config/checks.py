"""The config's rules across sections: keys of different sections that do not work together, refused with the
reason (``cross_section_problems``), and the rules that need the number of ranks (``world_size_problems``, checked
by the trainer once it knows it). Each section's own rules are its ``problems()`` (``titanrl.config.job_config``).
Standard library only, like the rest of the config package."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from titanrl.config.job_config import JobConfig


def cross_section_problems(cfg: "JobConfig") -> list[str]:
    """Every problem between sections of ``cfg``, in a fixed order."""
    found: list[str] = []
    if cfg.eval.enabled and not cfg.eval.path and (cfg.data.path or cfg.data.manifest):
        found.append("evaluation (eval.every / eval.before_train) needs eval.path with data.path set: a held-out "
                     "set is made only for synthesized data (titanrl cannot tell which of your rows were not "
                     "trained on)")
    if cfg.lora.enabled and cfg.rl.ref_offload:
        found.append("rl.ref_offload offloads a second copy of the base model, but with LoRA (lora.rank > 0) the "
                     "reference is the policy with its adapters off, with no copy to offload: drop rl.ref_offload")
    if cfg.model.freeze_vision_tower and cfg.lora.enabled and cfg.lora.vision:
        found.append("model.freeze_vision_tower = true keeps the vision tower as the checkpoint has it, but "
                     "lora.vision = true trains adapters on its blocks: drop one of them")
    if cfg.rl.algorithm == "grpo" and cfg.rollout.n < 2:
        found.append(
            f"rollout.n must be >= 2 for rl.algorithm='grpo' (advantages are relative to the "
            f"other responses of the same prompt), got {cfg.rollout.n}"
        )
    if cfg.rl.algorithm == "grpo" and cfg.rollout.temperature == 0:
        found.append(
            "rollout.temperature must be > 0 for rl.algorithm='grpo': greedy decoding gives "
            "identical responses, so every advantage is 0"
        )
    if cfg.rl.overlong_buffer and cfg.rl.overlong_buffer >= cfg.rollout.max_new_tokens:
        found.append(f"rl.overlong_buffer = {cfg.rl.overlong_buffer} must be below rollout.max_new_tokens = "
                     f"{cfg.rollout.max_new_tokens}: the punishment starts that many tokens before the limit")
    if cfg.balance.strategy == "bucketing" and cfg.parallelism.ulysses != "none":
        found.append(f"balance.strategy='bucketing' deals whole trajectories to ranks (verl's way), but "
                     f"parallelism.ulysses={cfg.parallelism.ulysses!r} shards them: use parallelism.ulysses='none' "
                     "or balance.strategy='lb_micro' / 'lb_mini' / 'odc'")
    if cfg.balance.strategy == "bucketing" and (cfg.balance.speeds() or cfg.balance.profile_speeds):
        found.append("balance.strategy='bucketing' deals equal counts to every rank; unequal rank speeds "
                     "(balance.rank_speeds, balance.profile_speeds) need balance.strategy='lb_micro', 'lb_mini' or 'odc'")
    if cfg.balance.strategy == "native" and cfg.parallelism.ulysses != "none":
        found.append(
            f"balance.strategy='native' keeps every trajectory on the rank that generated it, but "
            f"parallelism.ulysses={cfg.parallelism.ulysses!r} places trajectories on Ulysses groups: use "
            "balance.strategy='lb_micro', 'lb_mini' or 'odc'"
        )
    if cfg.balance.profile_speeds and cfg.balance.rank_speeds:
        found.append("balance.profile_speeds = true measures the speeds that balance.rank_speeds sets: use one")
    found += _multiturn_problems(cfg)
    tp = cfg.rollout.tensor_parallel_size
    if tp > 1 and cfg.rollout.engine != "vllm":
        found.append(f"rollout.tensor_parallel_size={tp} runs one vLLM engine over several ranks: set "
                     "rollout.engine = 'vllm', or rollout.tensor_parallel_size = 1")
    elif tp > 1 and cfg.workflow.placement == "disaggregated" and cfg.workflow.rollout_ranks % tp:
        found.append(f"rollout.tensor_parallel_size={tp} must divide workflow.rollout_ranks="
                     f"{cfg.workflow.rollout_ranks} (each engine spans that many rollout ranks)")
    if cfg.rollout.sleep == "on" and cfg.workflow.placement == "disaggregated":
        found.append("rollout.sleep = 'on' gives the engine's device memory to the training stages between "
                     "generations, but under workflow.placement = 'disaggregated' the rollout ranks do not train: "
                     "set rollout.sleep = 'auto' or 'off'")
    if cfg.data.slice_loading and cfg.data.loader != "shadow":
        found.append(
            f"data.slice_loading=true fetches slices through ShadowLoader's preprocessors, but "
            f"data.loader={cfg.data.loader!r} ships whole samples from rank 0: set data.slice_loading=false"
        )
    if cfg.data.ray_address and cfg.data.loader != "shadow":
        found.append(f"data.ray_address={cfg.data.ray_address!r} is the Ray cluster of ShadowLoader's "
                     f"preprocessors, but data.loader={cfg.data.loader!r} decodes on rank 0 without Ray: "
                     "leave data.ray_address empty or use data.loader='shadow'")
    spans, k = cfg.update_spans(), cfg.workflow.max_staleness
    if cfg.rollout.tokens_per_update < 0:
        found.append(f"rollout.tokens_per_update must be >= 0 (0 = the whole response at once), got "
                     f"{cfg.rollout.tokens_per_update}")
    elif spans - 1 > k:
        turns = f" x rollout.max_turns = {cfg.rollout.max_turns}" if cfg.rollout.max_turns > 1 else ""
        found.append(f"rollout.tokens_per_update = {cfg.rollout.tokens_per_update} lets a response of "
                     f"rollout.max_new_tokens = {cfg.rollout.max_new_tokens}{turns} span {spans} steps, so its first "
                     f"tokens would lag {spans - 1} policy versions, more than workflow.max_staleness = {k}: raise "
                     "one of them")
    elif (cfg.rollout.tokens_per_update and cfg.workflow.mode == "async"
          and cfg.workflow.placement == "disaggregated" and cfg.async_lead() < 1):
        found.append(f"workflow.mode = 'async' generates ahead, but workflow.max_staleness = {k} is used up by "
                     f"partial rollouts spanning {spans} steps (rollout.tokens_per_update = "
                     f"{cfg.rollout.tokens_per_update}): raise workflow.max_staleness to {spans} or more (the "
                     "rollout ranks then run max_staleness - (spans - 1) batches ahead)")
    from titanrl.workflow.graph import workflow_problems  # standard library only, like this module

    found += workflow_problems(cfg)
    prompt_and_response = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    if prompt_and_response > cfg.model.max_seq_len:
        found.append(
            f"data.max_prompt_tokens + rollout.max_new_tokens ({cfg.data.max_prompt_tokens} + "
            f"{cfg.rollout.max_new_tokens} = {prompt_and_response}) must be <= "
            f"model.max_seq_len ({cfg.model.max_seq_len})"
        )
    return found


def _multiturn_problems(cfg: "JobConfig") -> list[str]:
    """Multi-turn rollouts (rollout.max_turns > 1, rl.env): what they need, and what they do not run with yet."""
    turns, found = cfg.rollout.max_turns, []
    if turns > 1 and not cfg.rl.env:
        found.append(f"rollout.max_turns = {turns} needs an environment to answer each turn: set rl.env (e.g. "
                     "'titanrl.envs.zoom:ZoomEnv')")
    if cfg.rl.env and turns == 1:
        found.append(f"rl.env = {cfg.rl.env!r} answers turns after the first, but rollout.max_turns = 1: set "
                     "rollout.max_turns > 1, or leave rl.env empty")
    return found


def world_size_problems(cfg: "JobConfig", world_size: int) -> list[str]:
    """The problems of ``cfg`` on ``world_size`` ranks. Under the disaggregated placement the models' ranks are the
    ones after workflow.rollout_ranks."""
    found = []
    if cfg.workflow.placement == "disaggregated" and cfg.workflow.rollout_ranks >= world_size:
        return [f"workflow.rollout_ranks = {cfg.workflow.rollout_ranks} leaves none of the {world_size} ranks to "
                f"train: at most {world_size - 1}"]
    if cfg.balance.rank_speeds and len(cfg.balance.rank_speeds) != world_size:
        found.append(f"balance.rank_speeds names {len(cfg.balance.rank_speeds)} ranks, but the job has "
                     f"{world_size}: one speed per rank")
    tp = cfg.rollout.tensor_parallel_size
    if cfg.workflow.placement == "colocated" and world_size % tp:
        found.append(f"rollout.tensor_parallel_size = {tp} must divide the {world_size} ranks (each engine spans "
                     f"{tp} of them)")
    world_size = cfg.workflow.training_ranks(world_size)
    dp = cfg.data_parallel_degree(world_size)
    if dp != world_size and cfg.balance.strategy != "odc":
        found.append(
            f"parallelism.data_parallel_shard_degree ({dp}) must be -1 or equal the number of ranks ({world_size}): "
            "a smaller degree is hybrid sharding, built for balance.strategy='odc' only"
        )
    elif dp != world_size and (world_size % dp or dp > world_size):
        found.append(f"parallelism.data_parallel_shard_degree ({dp}) must divide the number of ranks ({world_size})")
    elif dp != world_size and cfg.workflow.placement != "colocated":
        found.append(f"parallelism.data_parallel_shard_degree ({dp}) below the ranks (hybrid sharding) runs with "
                     "workflow.placement='colocated' only")
    par = cfg.parallelism
    if par.ulysses == "fixed" and par.ulysses_degree > world_size:
        found.append(
            f"parallelism.ulysses_degree ({par.ulysses_degree}) must be <= the number of ranks ({world_size})"
        )
    elif par.ulysses == "fixed" and world_size % par.ulysses_degree:
        found.append(
            f"parallelism.ulysses_degree ({par.ulysses_degree}) must divide the number of "
            f"ranks ({world_size})"
        )
    if par.ulysses == "flex" and par.p_max is not None and par.p_max > world_size:
        found.append(
            f"parallelism.p_max ({par.p_max}) must be <= the number of ranks ({world_size})"
        )
    sequences_per_minibatch = cfg.rl.global_batch_size * cfg.rollout.n // cfg.rl.minibatches
    if sequences_per_minibatch < dp:
        found.append(
            f"each minibatch has rl.global_batch_size * rollout.n / rl.minibatches = "
            f"{sequences_per_minibatch} sequences, fewer than the {dp} data-parallel ranks"
        )
    return found


