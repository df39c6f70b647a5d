"""LoRA ([lora], ``titanrl.models.lora``): the adapted model against its base and against the merged weights, the
checkpoint and PEFT views, the memory model, the config's refusals, and (end to end) 2 ranks against 1 with every
parallel mode, a learning signal and the engine's log-probs after each push."""

from __future__ import annotations

import json
import math
import re
import shutil

import numpy as np
import pytest
import torch

from titanrl.config import JobConfig, parse_args
from titanrl.config.job_config import LoRAConfig


def _build(ckpt, lora: LoRAConfig | None, mesh=None, seed: int = 0):
    from titanrl.models.qwen2_5_vl import Qwen2_5_VLArgs
    from titanrl.parallel.parallelize import build_parallel_model

    args = Qwen2_5_VLArgs.from_pretrained(ckpt)
    return args, build_parallel_model(args, ckpt, device=torch.device("cpu"), dp_mesh=mesh, lora=lora, seed=seed)


def _logprobs(model, args, n: int = 40) -> torch.Tensor:
    """Per-token log-probs of one text sequence (every token scored)."""
    from titanrl.models.packed import pack_sequences
    from titanrl.models.qwen2_5_vl.inputs import make_sequence_input
    from titanrl.models.qwen2_5_vl.model import LogprobTargets

    ids = np.random.default_rng(0).integers(0, args.text.vocab_size, n).astype(np.int64)
    batch = pack_sequences([make_sequence_input(args, ids)]).to(torch.device("cpu"), torch.float32)
    pos = torch.arange(n - 1)
    with torch.no_grad():
        return model(batch, LogprobTargets(pos, batch.input_ids[pos + 1])).logprobs


def _randomise_b(model) -> None:
    """Give every adapter's B a non-zero value (a trained adapter), deterministically."""
    from titanrl.models.lora import lora_layers

    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, layer in lora_layers(model):
            w = layer.lora_b.weight
            w.copy_(torch.randn(w.shape, generator=gen) * 0.05)


def test_adapters_start_as_the_base_run_as_it_when_off_and_equal_their_merged_weights(tiny_ckpt):
    """B = 0 at first: the adapted model's log-probs equal the base model's exactly. With trained (non-zero)
    adapters they differ; with the adapters off they equal the base exactly again; and the model whose weights are
    the merged ones (W + alpha/r B A, what the engines and HF export get) gives the adapted log-probs within float32
    rounding. Only the adapters require gradients."""
    from titanrl.models.lora import adapters_disabled, lora_layers, merge_adapters, scales
    from titanrl.models.qwen2_5_vl import Qwen2_5_VLModel
    from titanrl.rl.weight_sync import gather_full_state

    args, base = _build(tiny_ckpt, None)
    lora = LoRAConfig(rank=4, alpha=8.0)
    _, model = _build(tiny_ckpt, lora)
    layers = dict(lora_layers(model))
    assert len(layers) == 7 * args.text.num_hidden_layers  # q, k, v, o, gate, up, down of every decoder layer
    assert all(not n.startswith("vision.") for n in layers)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable), sorted(trainable)[:4]
    assert all(layer.scale == 2.0 for layer in layers.values())

    ref = _logprobs(base, args)
    assert torch.equal(_logprobs(model, args), ref)
    _randomise_b(model)
    adapted = _logprobs(model, args)
    assert (adapted - ref).abs().max() > 1e-3
    with adapters_disabled(model):
        assert torch.equal(_logprobs(model, args), ref)
    assert torch.equal(_logprobs(model, args), adapted)  # back on after the block

    merged = dict(merge_adapters(gather_full_state(model, None), scales(model)))
    assert not any(".lora_" in n for n in merged) and set(merged) == set(base.state_dict())
    plain = Qwen2_5_VLModel(args)
    plain.load_state_dict(merged)
    plain.reinit_buffers()
    got = _logprobs(plain, args)
    assert (got - adapted).abs().max() <= 1e-4 * max(1.0, float(adapted.abs().max())), (got - adapted).abs().max()


def test_with_modules_trained_in_full_adapters_off_is_the_base_whole(tiny_ckpt, one_rank_mesh):
    """lora.modules_to_save with the KL term: ``keep_base`` keeps the head's and final norm's base values, and
    ``adapters_disabled`` is then the base model exactly, however far the adapters, head and norm trained (FSDP2 on a
    one-rank mesh, the root gathered by a forward before, as the probe leaves it); afterwards the trained values are
    back bit for bit and the model gives the adapted log-probs again."""
    from titanrl.models.lora import adapters_disabled, keep_base, lora_layers

    args, base = _build(tiny_ckpt, None)
    ref = _logprobs(base, args)
    lora = LoRAConfig(rank=4, alpha=8.0, modules_to_save=["lm_head", "norm"])
    _, model = _build(tiny_ckpt, lora, mesh=one_rank_mesh)
    keep_base(model, lora.modules_to_save)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, layer in lora_layers(model):  # trained adapters
            w = layer.lora_b.weight.to_local()
            w.copy_(torch.randn(w.shape, generator=gen) * 0.05)
        for name in ("output.weight", "norm.weight"):
            p = model.get_parameter(name)
            p.to_local().mul_(1.5).add_(0.01)  # trained in full
    trained = {n: p.to_local().clone() for n, p in model.named_parameters()}
    adapted = _logprobs(model, args)  # (FSDP2 keeps the root gathered after a forward without backward)
    assert (adapted - ref).abs().max() > 1e-2
    calls = []
    with adapters_disabled(model, quiesce=lambda: calls.append(1)):
        assert torch.allclose(_logprobs(model, args), ref, rtol=0, atol=1e-6)
    assert len(calls) == 2
    assert all(torch.equal(p.to_local(), trained[n]) for n, p in model.named_parameters())
    assert torch.equal(_logprobs(model, args), adapted)


def test_adapter_init_is_the_same_for_any_seed_name_and_sharding(tiny_ckpt, one_rank_mesh):
    """A's initial value is PEFT's (uniform within 1 / sqrt(in_features)), drawn from the run's seed and the
    layer's name, so a model sharded by FSDP2 (DTensor adapters) starts with the same adapters as a plain one; a
    different seed draws other ones; B starts at zero."""
    from titanrl.models.lora import lora_layers
    from titanrl.rl.weight_sync import gather_full_state

    lora = LoRAConfig(rank=4, vision=True)
    _, plain = _build(tiny_ckpt, lora)
    _, sharded = _build(tiny_ckpt, lora, mesh=one_rank_mesh)
    _, other = _build(tiny_ckpt, lora, seed=1)
    a = {n: t for n, t in gather_full_state(plain, None) if ".lora_" in n}
    b = {n: t for n, t in gather_full_state(sharded, None) if ".lora_" in n}
    c = {n: t for n, t in gather_full_state(other, None) if ".lora_" in n}
    assert set(a) == set(b) == set(c) and any(n.startswith("vision.blocks.") for n in a)
    for name, layer in lora_layers(plain):
        bound = 1 / math.sqrt(layer.in_features)
        wa = a[f"{name}.lora_a.weight"]
        assert float(wa.abs().max()) <= bound and float(wa.abs().max()) > bound / 2
        assert torch.equal(wa, b[f"{name}.lora_a.weight"]) and not torch.equal(wa, c[f"{name}.lora_a.weight"])
        assert not a[f"{name}.lora_b.weight"].any()


def test_checkpoint_view_holds_the_adapters_and_peft_export_names_them_as_peft_does(tiny_ckpt, tmp_path):
    """The checkpoint's model view (``AdapterCheckpoint``) saves the adapters only and restores them (refusing a
    state without them); ``write_peft`` writes PEFT's file names, keys and config."""
    from safetensors.torch import load_file

    from titanrl.models.lora import AdapterCheckpoint, write_peft

    args, model = _build(tiny_ckpt, LoRAConfig(rank=4, targets=["q_proj", "v_proj"]))
    view = AdapterCheckpoint(model)
    saved = view.state_dict()
    assert saved and all(".lora_" in k for k in saved) and len(saved) == 4 * args.text.num_hidden_layers
    _randomise_b(model)
    trained = {k: v.clone() for k, v in view.state_dict().items()}
    _, fresh = _build(tiny_ckpt, LoRAConfig(rank=4, targets=["q_proj", "v_proj"]))
    AdapterCheckpoint(fresh).load_state_dict(trained)
    assert all(torch.equal(AdapterCheckpoint(fresh).state_dict()[k], v) for k, v in trained.items())
    with pytest.raises(KeyError, match="no adapter"):
        AdapterCheckpoint(fresh).load_state_dict({})

    out = write_peft(trained, tmp_path / "adapter", rank=4, alpha=16.0, dropout=0.0, base="base-model")
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 16.0)
    assert config["target_modules"] == ["q_proj", "v_proj"]
    tensors = load_file(out / "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
    assert tensors["base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"].shape[1] == 4
    assert len(tensors) == len(trained)


def test_memory_plan_counts_the_adapters_and_7b_rank_64_fits_one_80gb_gpu():
    """``python -m titanrl.memory``: with LoRA the base is counted in model.dtype, gradients and AdamW state for
    the adapters only, and no reference copy; Qwen2.5-VL-7B with rank 64 on the language model is predicted to fit
    one 80 GB GPU (it does not without LoRA). The adapter count is PEFT's r (in + out) per adapted layer."""
    from titanrl import memory

    argv = ["--config", "configs/qwen2_5_vl_7b.toml", "--parallelism.ulysses=none", "--parallelism.p_max=1"]
    args, _ = memory.resolve_shape(parse_args(argv), "qwen2_5_vl_7b")
    full = memory.predict(parse_args(argv), args, 1, device="cuda")
    cfg = parse_args(argv + ["--lora.rank=64"])
    lora = memory.predict(cfg, args, 1, device="cuda")
    t = args.text
    per_layer = 2 * (2 * t.hidden_size) + 2 * (t.hidden_size + t.num_key_value_heads * t.head_dim) \
        + 3 * (t.hidden_size + t.intermediate_size)
    assert memory.lora_params(args, cfg.lora) == 64 * per_layer * t.num_hidden_layers
    assert lora.term("reference_model") == 0 and lora.term("optimizer") < full.term("optimizer") / 40
    # lora.modules_to_save with the KL term: the head's base values kept, and its trained ones while swapped out
    saved = memory.predict(parse_args(argv + ["--lora.rank=64", "--lora.modules_to_save=lm_head"]), args, 1,
                           device="cuda")
    assert saved.term("reference_model") == 8 * t.vocab_size * t.hidden_size < full.term("reference_model") / 5
    capacity = memory.parse_bytes("80GB")
    memory.check_fits(lora, int(capacity * 0.93), cfg)
    with pytest.raises(Exception, match="does not fit"):
        memory.check_fits(full, int(capacity * 0.93), parse_args(argv))


def test_config_refusals():
    from titanrl.config import ConfigError

    bad = {"--lora.rank=-1": "lora.rank must be >= 0", "--lora.alpha=0": "lora.alpha must be > 0",
           "--lora.dropout=1": "lora.dropout must be in [0, 1)",
           "--lora.targets=q_proj,wq": "unknown module names ['wq']",
           "--lora.modules_to_save=lm_head,head": "unknown modules ['head']",
           "--lora.rank=8 --lora.targets=qkv": "adapts nothing",
           # a second copy of the base to offload does not exist: refused with the reason
           "--lora.rank=8 --rl.kl_coef=0.01 --rl.ref_offload=true": "with LoRA (lora.rank > 0) the reference is "
                                                                    "the policy with its adapters off",
           "--lora.rank=8 --lora.vision --model.freeze_vision_tower": "lora.vision = true trains adapters on its "
                                                                      "blocks: drop one of them"}
    for flags, message in bad.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            parse_args(flags.split())
    assert not JobConfig().lora.enabled and parse_args(["--lora.rank=8"]).lora.enabled
    # modules trained in full with the KL term: the reference swaps their base values in (no copy to offload)
    parse_args("--lora.rank=8 --lora.modules_to_save=lm_head --rl.kl_coef=0.01".split())
    with pytest.raises(ConfigError, match="no copy to offload"):
        parse_args("--lora.rank=8 --lora.modules_to_save=lm_head --rl.kl_coef=0.01 --rl.ref_offload=true".split())


# LoRA on the language model and the vision blocks, the final norm trained in full (lora.modules_to_save), with the
# reference (rl.kl_coef > 0) as the policy with its adapters off and the norm's base values swapped in, the HF export
# (merged weights + PEFT adapters), 3 steps with a learning signal (tests/train_runs.py)
LORA = ("--lora.rank=8", "--lora.alpha=16", "--lora.vision", "--lora.modules_to_save=norm", "--job.steps=3",
        "--checkpoint.export_hf")


def test_two_ranks_with_every_parallel_mode_equal_one_process(tmp_path, run_cache):
    """2 ranks with FlexUlysses, vision balancing, lb_mini, shared-prefix packing and slice-aware loading against
    one process (lb_micro, no shared prefix): per-token log-probs (rollout, old, reference) within 1e-5 in the first
    step and 1e-4 after, adapter (and norm) updates within 1e-4 of their size over 3 steps with non-zero
    advantages; the rest of the base never moves; the engines' log-probs after every push equal the trainer's (the weight-sync probe, merged
    weights); the export's merged weights are W + alpha/r B A of the last step's adapters, and its adapters
    folder is PEFT's."""
    from safetensors import safe_open

    from titanrl.models.qwen2_5_vl.state_dict_adapter import hf_name
    from titanrl.rl.dump import load_dumps, max_differences
    from train_runs import assert_same_computation, metrics, train_tiny

    one_dir, one = train_tiny(tmp_path, run_cache, "one", 1, "--balance.strategy=lb_micro",
                              "--rl.shared_prefix=false", *LORA)
    # the 2-rank run also saves checkpoints (steps 2 and 3): the resume below
    two_args = ("--parallelism.ulysses=flex", "--parallelism.vision_balance=true", *LORA, "--checkpoint.enable=true",
                "--checkpoint.interval=2")
    two_dir, two = train_tiny(tmp_path, run_cache, "two", 2, *two_args)
    seen = assert_same_computation(one_dir, two_dir, steps=3)
    assert {"rollout_logprobs", "old_logprobs", "ref_logprobs", "update/policy"} <= set(seen), seen
    for records in (one, two):
        probes = [r["probe/logprob_max_diff"] for r in records if "probe/logprob_max_diff" in r]
        assert len(probes) == 3 and max(probes) <= 1e-4, probes
    assert max(r["parallel/sharded_sequences"] for r in two) > 0

    dumps = load_dumps(two_dir)
    first, last = dumps[1]["params"]["policy"], dumps[3]["params"]["policy"]
    base = [k for k in first if ".lora_" not in k and k != "norm.weight"]
    assert all(torch.equal(first[k], last[k]) for k in base)  # frozen: bit for bit
    assert float((last["norm.weight"] - first["norm.weight"]).abs().max()) > 1e-4  # trained in full
    adapters = [k for k in first if ".lora_" in k]
    assert any(k.startswith("vision.blocks.") for k in adapters)
    assert max(float((last[k] - first[k]).abs().max()) for k in adapters) > 1e-4
    # the reference (adapters off) differs from the adapted policy once the adapters moved
    traj = next(iter(dumps[3]["trajectories"].values()))
    assert np.abs(traj["ref_logprobs"] - traj["old_logprobs"]).max() > 0

    hf = two_dir / "hf"
    index = {}
    for f in hf.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            index.update({k: h.get_tensor(k) for k in h.keys()})
    layer = "layers.0.attention.wq"
    want = last[f"{layer}.weight"] + 2.0 * last[f"{layer}.lora_b.weight"] @ last[f"{layer}.lora_a.weight"]
    assert torch.allclose(index[hf_name(f"{layer}.weight")].float(), want, atol=1e-6)
    assert not any("lora" in k for k in index)
    config = json.loads((hf / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and "qkv" in config["target_modules"]

    # the checkpoint holds the adapters (and their optimizer state), not the base; a rerun resumes from step 2 and
    # computes step 3 again as the uninterrupted run did, the rerun under balance.strategy = odc (its parameter
    # shards live in shared memory, where the checkpoint load writes them; frozen base: no gradient pushed for it)
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(two_dir / "checkpoint" / "step-2")).read_metadata().state_dict_metadata
    weights = [k for k in saved if k.endswith(".weight") and not k.startswith("optimizer")]
    assert weights and all(".lora_" in k or k.removeprefix("model.") == "norm.weight" for k in weights), weights[:4]
    uninterrupted = dumps[3]
    shutil.rmtree(two_dir / "checkpoint" / "step-3")
    (two_dir / "tensors" / "step3.pt").unlink()
    train_tiny(tmp_path, run_cache, "two", 2, *two_args, "--balance.strategy=odc")
    resumed = load_dumps(two_dir)[3]
    diff = max_differences(uninterrupted, resumed)
    assert all(v <= 1e-6 for v in diff.values()), diff
    assert metrics(two_dir)[3]["balance/syncs_per_minibatch"] == 1.0


def test_push_layout_lists_the_merged_tensors_in_the_order_the_push_sends_them(tiny_ckpt):
    """The disaggregated push plans its broadcast buckets from ``hf_layout`` and checks each tensor's name as it is
    sent: with adapters the merged weight leaves after its bias (once ``lora_b`` has passed), and the layout says so
    (an earlier layout in state-dict order stopped every LoRA run on disaggregated placement at the first push)."""
    from titanrl.rl.weight_sync import hf_layout, hf_state

    args, model = _build(tiny_ckpt, LoRAConfig(rank=4, vision=True))
    layout = hf_layout(model, args, torch.float32)
    sent = [(name, tuple(t.shape)) for name, t in hf_state(model, args, torch.float32)]
    assert [(name, info.shape) for name, info in layout.items()] == sent
    assert not any("lora" in name for name, _ in sent)


@pytest.mark.parametrize("way", ["frozen_tower", "lora", "lora_vision_head", "full"])
def test_the_push_after_the_first_holds_what_trains_in_whole_engine_modules(tiny_ckpt, way):
    """What the push sends once the engines have the whole model (``changing_units``): every unit holding a trained
    parameter, whole, so that vLLM's fused modules (q/k/v, gate/up) and a weight's bias always arrive together
    (``check_update`` against the whole layout with vLLM's packing accepts it), and nothing of what cannot change."""
    from titanrl.models.qwen2_5_vl import Qwen2_5_VLArgs
    from titanrl.parallel.parallelize import build_parallel_model
    from titanrl.rl.weight_sync import changing_units, hf_layout, push_unit
    from titanrl.rollout.weights import QWEN2_5_VL_PACKED_MODULES, check_update

    args = Qwen2_5_VLArgs.from_pretrained(tiny_ckpt)
    lora = {"lora": LoRAConfig(rank=4), "lora_vision_head": LoRAConfig(rank=4, vision=True, targets=["v_proj"],
                                                                        modules_to_save=["lm_head"])}.get(way)
    model = build_parallel_model(args, tiny_ckpt, device=torch.device("cpu"), dp_mesh=None, lora=lora,
                                 freeze_vision=way == "frozen_tower")
    only = changing_units(model)
    if way == "full":
        assert only is None  # every unit trains: the whole model each time
        return
    full, part = hf_layout(model, args, torch.float32), hf_layout(model, args, torch.float32, only)
    check_update(full, part, where=way, packed=QWEN2_5_VL_PACKED_MODULES)
    assert 0 < len(part) < len(full) and list(part) == [n for n in full if n in part]
    assert any("visual." in n for n in part) == (way == "lora_vision_head")  # its blocks hold adapters
    assert not any("patch_embed" in n or "merger" in n for n in part)
    assert any(".layers.0." in n for n in part) and ("lm_head.weight" in part) == (way != "lora")
    assert not any("lora" in n for n in part)  # merged weights, no adapters
    assert all(push_unit(n) in {"tok_embeddings", "norm", "output"} or n.startswith(("layers.", "vision.blocks."))
               for n, p in model.named_parameters() if p.requires_grad)


def test_modules_to_save_train_in_full_are_checkpointed_exported_and_counted(tiny_ckpt, tmp_path):
    """lora.modules_to_save (PEFT's name): the output head and final norm train in full, in float32, beside the
    adapters; the checkpoint view holds them, the PEFT folder saves them under their HF names and lists them, and
    the memory plan counts them as trained."""
    from safetensors.torch import load_file

    from titanrl import memory
    from titanrl.models.lora import AdapterCheckpoint, write_peft

    lora = LoRAConfig(rank=4, targets=["q_proj"], modules_to_save=["lm_head", "norm"])
    args, model = _build(tiny_ckpt, lora)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {"output.weight", "norm.weight"} <= trained
    assert all(".lora_" in n or n in ("output.weight", "norm.weight") for n in trained), sorted(trained)
    saved = AdapterCheckpoint(model).state_dict()
    assert set(saved) == trained
    adapters = {k: v for k, v in saved.items() if ".lora_" in k}
    full = {k: v for k, v in saved.items() if ".lora_" not in k}
    out = write_peft(adapters, tmp_path / "adapter", rank=4, alpha=16.0, dropout=0.0, base="b", full=full)
    assert json.loads((out / "adapter_config.json").read_text())["modules_to_save"] == ["lm_head", "norm"]
    tensors = load_file(out / "adapter_model.safetensors")
    assert {"base_model.model.lm_head.weight", "base_model.model.model.norm.weight"} <= set(tensors)
    t = args.text
    head = t.vocab_size * t.hidden_size  # the output head (tied or not: the matrix once)
    assert memory.lora_params(args, lora) == memory.lora_params(args, LoRAConfig(rank=4, targets=["q_proj"])) \
        + head + t.hidden_size


@pytest.mark.slow
def test_lora_ppo_compiled_on_the_hf_engine_with_evaluation_on_two_ranks_equals_one_process(tmp_path, run_cache):
    """Flags combined that no other test combines: LoRA adapters with PPO's critic, generation and evaluation on the
    hf engine (``rollout.engine = "hf"``, which takes the merged weights in place), compiled on 2 ranks against one
    eager process. Per-token log-probs, values and advantages within 1e-5, adapter and critic updates within 0.1% of
    their size with a learning signal (the shared equality check at ``test_compile``'s update tolerance: inductor's
    fused kernels round differently from eager); the LoRA blocks compiled once (``compile/recompiles`` 0 after step
    1); the same evaluations (before training and after step 2: responses, rewards, ``eval/*``); and the hf
    engine's log-probs after every push equal the trainer's. The final norm trains in full (lora.modules_to_save)
    with the KL term on: the reference is the policy with adapters off and the norm's base values swapped in,
    equal to the policy before its first update and apart from it after."""
    from titanrl.rl.dump import load_dumps
    from train_runs import EVAL, SIGNAL, assert_same_computation, metric_records, metrics, run_tiny, same_evaluations

    common = ["--rollout.engine=hf", "--rl.algorithm=ppo", "--lora.rank=8", "--lora.alpha=16", "--job.steps=2",
              "--lora.modules_to_save=norm", "--rl.kl_coef=0.01",
              "--checkpoint.enable=false", "--metrics.dump_tensors", "--rl.old_logprobs=recompute",
              "--rl.minibatches=2", "--rl.global_batch_size=4", *EVAL, *SIGNAL]
    one = run_tiny(tmp_path / "one", run_cache, 1, *common)
    two = run_tiny(tmp_path / "two", run_cache, 2, *common, "--compile.enable=true")
    seen = assert_same_computation(one, two, steps=2, update_rtol=1e-3)
    assert {"rollout_logprobs", "old_logprobs", "ref_logprobs", "update/policy", "update/critic"} <= set(seen), seen
    dumps = load_dumps(one)
    gaps = {step: max(float(np.abs(t["ref_logprobs"] - t["old_logprobs"]).max())
                      for t in dumps[step]["trajectories"].values()) for step in (1, 2)}
    assert gaps[1] <= 1e-5 and gaps[2] > 1e-4, gaps  # old log-probs are the policy's before each step's update
    assert float((dumps[2]["params"]["policy"]["norm.weight"] - dumps[1]["params"]["policy"]["norm.weight"])
                 .abs().max()) > 1e-4
    compiled = metrics(two)
    assert compiled[1]["compile/recompiles"] > 0 and compiled[2]["compile/recompiles"] == 0, compiled
    assert same_evaluations(one, two) == [0, 2]
    for records in (metric_records(one), metric_records(two)):
        probes = [r["probe/logprob_max_diff"] for r in records if "probe/logprob_max_diff" in r]
        assert len(probes) == 2 and max(probes) <= 1e-4, probes
