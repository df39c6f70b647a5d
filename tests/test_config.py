"""Config system: shipped TOML files, overrides, error messages, validation, round trip."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from titanrl.config import (
    ConfigError,
    JobConfig,
    config_from_dict,
    config_to_dict,
    config_to_toml,
    load_config,
    parse_args,
    save_resolved,
)
from titanrl.config.help import format_help
from titanrl.config.schema import all_keys, fields_of, lookup, optional_inner, table_list_of

REPO = Path(__file__).resolve().parents[1]
SHIPPED_CONFIGS = sorted((REPO / "configs").glob("*.toml"))


def overridden(*overrides: str, validate: bool = False) -> JobConfig:
    return load_config(None, list(overrides), validate=validate)


def config_error(*overrides: str, path: Path | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    message = str(info.value)
    assert message.startswith("config error: ")
    return message


# A schema with a nested section, a list[str] and an Optional, to test the generic machinery on
# shapes JobConfig does not have (yet).
@dataclass(kw_only=True, slots=True)
class KLConfig:
    coef: float = 0.0
    """KL weight."""
    estimator: Literal["k1", "k3"] = "k3"
    """KL estimator."""


@dataclass(kw_only=True, slots=True)
class NestedRLConfig:
    kl: KLConfig = field(default_factory=KLConfig)
    tags: list[str] = field(default_factory=list)
    """Free-form tags."""
    budget: int | None = None
    """Optional budget."""


@dataclass(kw_only=True, slots=True)
class NestedRoot:
    rl: NestedRLConfig = field(default_factory=NestedRLConfig)


# ---------------------------------------------------------------- shipped files and schema rules


def test_the_expected_configs_are_shipped():
    expected = {"tiny_cpu.toml", "small_cpu.toml", "qwen2_5_vl_7b.toml"}
    assert {p.name for p in SHIPPED_CONFIGS} >= expected


@pytest.mark.parametrize("path", SHIPPED_CONFIGS, ids=lambda p: p.name)
def test_shipped_config_loads_and_validates(path):
    cfg = load_config(path)
    assert isinstance(cfg, JobConfig)
    # Every shipped file sets every key, so a change of defaults never changes a shipped run.
    # (Optional keys may be left out: unset has a meaning of its own, e.g. "the checkpoint's value".)
    keys = set(_flatten(tomllib.loads(path.read_text())))
    required = {k for k in all_keys(JobConfig) if optional_inner(lookup(JobConfig, k, "")[1].type) is None}
    assert required <= keys <= set(all_keys(JobConfig))


def test_tiny_cpu_is_the_default():
    assert load_config(REPO / "configs" / "tiny_cpu.toml") == JobConfig()
    assert parse_args([]) == JobConfig()


def test_shipped_flavors():
    small = load_config(REPO / "configs" / "small_cpu.toml")
    assert small.model.flavor == "small"
    qwen = load_config(REPO / "configs" / "qwen2_5_vl_7b.toml")
    assert (qwen.model.path, qwen.model.dtype, qwen.model.attn_backend) == ("", "bfloat16", "flash")
    assert qwen.rollout.engine == "vllm"
    assert qwen.rl.global_batch_size >= 64


def test_sections():
    assert list(fields_of(JobConfig)) == [
        "job", "model", "data", "parallelism", "balance", "rollout", "rl", "optimizer",
        "lr_scheduler", "checkpoint", "metrics", "compile", "critic", "eval", "lora", "workflow",
    ]  # fmt: skip
    assert all(spec.is_section for spec in fields_of(JobConfig).values())


def test_every_field_has_a_doc_and_optional_fields_default_to_none():
    defaults = JobConfig()
    for key in all_keys(JobConfig):
        path, spec = lookup(JobConfig, key, "")
        assert spec.doc, f"{key} has no docstring"
        if optional_inner(spec.type) is not None:  # TOML has no null; see job_config.py
            assert _get(defaults, path) is None, key


def test_importing_the_config_does_not_import_torch():
    code = (
        "import sys, titanrl.config as c; c.parse_args(['--config', 'configs/qwen2_5_vl_7b.toml']);"
        "heavy = [m for m in ('torch', 'numpy', 'torchtitan', 'transformers') if m in sys.modules];"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


# ---------------------------------------------------------------- overrides


def test_equals_and_space_separated_forms():
    cfg = overridden("--optimizer.lr=0.5", "--rollout.n", "8", "--job.name", "run-a")
    assert (cfg.optimizer.lr, cfg.rollout.n, cfg.job.name) == (0.5, 8, "run-a")


def test_values_are_parsed_against_the_declared_type():
    cfg = overridden("--job.name=1e3", "--optimizer.lr=1", "--rollout.kv_cache_bytes=4e9")
    assert cfg.job.name == "1e3"  # str stays verbatim, not guessed to be a number
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)
    assert cfg.rollout.kv_cache_bytes == 4_000_000_000
    assert isinstance(cfg.rollout.kv_cache_bytes, int)


def test_negative_number_as_separate_token():
    cfg = overridden("--parallelism.data_parallel_shard_degree", "-1", "--rl.entropy_coef", "-0.5")
    assert cfg.parallelism.data_parallel_shard_degree == -1
    assert cfg.rl.entropy_coef == -0.5


@pytest.mark.parametrize(
    "tokens, expected",
    [
        (["--compile.enable"], True),
        (["--compile.enable=true"], True),
        (["--compile.enable=false"], False),
        (["--compile.enable", "false"], False),
        (["--compile.enable", "yes"], True),
        (["--compile.enable=0"], False),
        (["--compile.enable", "--no-compile.enable"], False),
        (["--no-compile.enable", "--compile.enable"], True),
    ],
)
def test_booleans(tokens, expected):
    assert overridden(*tokens).compile.enable is expected


def test_bare_boolean_flag_does_not_eat_the_next_override():
    cfg = overridden("--compile.enable", "--rollout.n", "6")
    assert cfg.compile.enable is True and cfg.rollout.n == 6


@pytest.mark.parametrize(
    "token, expected",
    [
        ("--optimizer.betas=[0.8,0.95]", [0.8, 0.95]),
        ("--optimizer.betas=[0.8, 0.95]", [0.8, 0.95]),
        ("--optimizer.betas=0.8,0.95", [0.8, 0.95]),
        ("--optimizer.betas=[1,0]", [1.0, 0.0]),
        ("--optimizer.betas=[]", []),
        ("--optimizer.betas=", []),
    ],
)
def test_float_lists(token, expected):
    assert overridden(token).optimizer.betas == expected


@pytest.mark.parametrize(
    "token",
    ["--compile.components=[model,loss]", '--compile.components=["model", "loss"]',
     "--compile.components=model,loss", "--compile.components=['model','loss']"],
)  # fmt: skip
def test_literal_lists(token):
    assert overridden(token).compile.components == ["model", "loss"]


def test_literal():
    assert overridden("--model.dtype=bfloat16").model.dtype == "bfloat16"
    assert overridden("--rl.loss_agg", "seq-mean-token-sum").rl.loss_agg == "seq-mean-token-sum"


def test_optional():
    assert overridden("--lr_scheduler.decay_steps=10").lr_scheduler.decay_steps == 10
    unset = overridden("--lr_scheduler.decay_steps=10", "--lr_scheduler.decay_steps=none")
    assert unset.lr_scheduler.decay_steps is None
    assert overridden("--rollout.seed", "NULL").rollout.seed is None


def test_nested_sections_lists_of_str_and_optional_on_a_generic_schema():
    cfg = load_config(
        None,
        ["--rl.kl.coef=0.1", "--rl.kl.estimator", "k1", "--rl.tags=[a,b c]", "--rl.budget=3"],
        root=NestedRoot,
    )
    kl = KLConfig(coef=0.1, estimator="k1")
    assert cfg == NestedRoot(rl=NestedRLConfig(kl=kl, tags=["a", "b c"], budget=3))
    assert load_config(None, ['--rl.tags=["x,y", "z"]'], root=NestedRoot).rl.tags == ["x,y", "z"]
    assert load_config(None, ["--rl.tags=[1,2]"], root=NestedRoot).rl.tags == ["1", "2"]
    table = tomllib.loads(config_to_toml(cfg))
    kl_table = {"coef": 0.1, "estimator": "k1"}
    assert table == {"rl": {"tags": ["a", "b c"], "budget": 3, "kl": kl_table}}
    assert config_from_dict(table, root=NestedRoot) == cfg


def test_later_overrides_win_and_dashes_mean_underscores():
    cfg = overridden("--rl.global-batch-size=8", "--rl.global_batch_size=16", "rollout.n=3")
    assert cfg.rl.global_batch_size == 16 and cfg.rollout.n == 3


def test_overrides_apply_on_top_of_the_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[rollout]\nn = 6\ntemperature = 0.7\n")
    cfg = parse_args(["--config", str(path), "--rollout.n=3"])
    assert (cfg.rollout.n, cfg.rollout.temperature) == (3, 0.7)
    assert parse_args([f"--config={path}"]).rollout.n == 6


# ---------------------------------------------------------------- error messages


def test_unknown_section_lists_sections_and_closest_match():
    message = config_error("--optimiser.lr=0.1")
    assert "unknown section 'optimiser'" in message
    assert "did you mean 'optimizer'?" in message
    assert "job, model, data, parallelism" in message and "compile" in message


def test_unknown_key_lists_keys_and_closest_match():
    message = config_error("--optimizer.lrr=0.1")
    assert "unknown key 'optimizer.lrr' (from --optimizer.lrr)" in message
    assert "did you mean 'optimizer.lr'?" in message
    assert "name, lr, betas, eps, weight_decay, max_grad_norm" in message


def test_unknown_key_that_lives_in_another_section():
    assert "did you mean 'rollout.temperature'?" in config_error("--rl.temperature=0.5")


def test_unknown_nested_key():
    expected = r"unknown key 'rl.kl.coeff'.*did you mean 'rl.kl.coef'\?.*coef, estimator"
    with pytest.raises(ConfigError, match=expected):
        load_config(None, ["--rl.kl.coeff=1"], root=NestedRoot)


@pytest.mark.parametrize(
    "token, expected",
    [
        ("--optimizer.lr=fast", "optimizer.lr expects float, got 'fast' (from --optimizer.lr)"),
        ("--rollout.n=2.5", "rollout.n expects int, got '2.5' (from --rollout.n); not a whole number"),
        ("--rollout.n=many", "rollout.n expects int, got 'many' (from --rollout.n)"),
        ("--compile.enable=maybe", "compile.enable expects bool, got 'maybe' (from --compile.enable)"),
        ("--model.dtype=fp16", "model.dtype expects one of 'float32', 'bfloat16', got 'fp16' (from --model.dtype)"),
        ("--optimizer.betas=[0.9,x]", "optimizer.betas expects list[float], got '[0.9,x]' (from --optimizer.betas); element 'x' is not a float"),
        ("--compile.components=model,graph", "expects list[one of 'model', 'loss'], got 'model,graph'"),
        ("--lr_scheduler.decay_steps=soon", "lr_scheduler.decay_steps expects int or none, got 'soon'"),
        ("--optimizer.lr=nan", "optimizer.lr expects float, got 'nan' (from --optimizer.lr); not a finite number"),
    ],
)
def test_wrong_type_names_key_type_and_value(token, expected):
    assert expected in config_error(token)


def test_missing_value_section_as_value_and_stray_argument():
    assert "rollout.n expects int, got no value" in config_error("--rollout.n")
    assert "rollout.n expects int, got no value" in config_error("--rollout.n", "--rl.n=2")
    assert "'rl' is a section, not a value" in config_error("--rl=3")
    assert "'rollout.n' is a int value, not a section" in config_error("--rollout.n.x=3")
    assert "unexpected argument 'stray'" in config_error("stray")
    assert "unexpected argument '--'" in config_error("--")
    assert "--no-rollout.n: the --no- form is only for boolean keys" in config_error("--no-rollout.n")
    with pytest.raises(ConfigError, match="--config expects a path"):
        parse_args(["--config"])


def test_toml_unknown_key_names_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[optimizer]\nlrr = 0.1\n")
    message = config_error(path=path)
    assert f"unknown key 'optimizer.lrr' (from {path})" in message
    assert "did you mean 'optimizer.lr'?" in message and "weight_decay" in message


def test_toml_unknown_section_names_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[rollouts]\nn = 4\n")
    message = config_error(path=path)
    assert f"unknown section 'rollouts' (from {path}); did you mean 'rollout'?" in message


def test_toml_wrong_types(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[optimizer]\nlr = "1e-4"\n')
    message = config_error(path=path)
    assert f"optimizer.lr expects float, got '1e-4' (from {path})" in message
    assert "without quotes" in message
    path.write_text("[rollout]\nn = true\n")
    assert "rollout.n expects int, got true" in config_error(path=path)
    path.write_text("rollout = 3\n")
    assert "'rollout' is a section: write it as a [rollout] table, got 3" in config_error(path=path)
    path.write_text("[rollout.n]\nx = 1\n")
    assert "rollout.n expects int, got a table" in config_error(path=path)


def test_toml_accepts_ints_for_floats_and_whole_floats_for_ints(tmp_path):
    path = tmp_path / "ok.toml"
    path.write_text("[optimizer]\nlr = 1\n[rollout]\nkv_cache_bytes = 4e9\n")
    cfg = load_config(path)
    assert cfg.optimizer.lr == 1.0 and cfg.rollout.kv_cache_bytes == 4_000_000_000


def test_unreadable_files(tmp_path):
    assert "config file not found" in config_error(path=tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[rl\n")
    assert f"{broken} is not valid TOML" in config_error(path=broken)


def test_entry_point_prints_the_error_without_traceback_and_exits_2():
    result = subprocess.run(
        [sys.executable, "-m", "titanrl.config", "--optimizer.lr=fast"],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 2
    expected = "config error: optimizer.lr expects float, got 'fast' (from --optimizer.lr)"
    assert result.stderr.strip() == expected


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "tokens, expected",
    [
        (["--rollout.n=1"], "rollout.n must be >= 2 for rl.algorithm='grpo'"),
        (["--optimizer.lr=0"], "optimizer.lr must be > 0, got 0.0"),
        (["--checkpoint.interval=0"], "checkpoint.interval must be > 0, got 0"),
        (["--rl.global_batch_size=6", "--rl.minibatches=4"], "rl.global_batch_size (6) must be divisible by rl.minibatches (4)"),
        (["--model.attn_backend=flash"], "model.attn_backend='flash' needs model.dtype='bfloat16'"),
        (["--rollout.max_new_tokens=300"], "data.max_prompt_tokens + rollout.max_new_tokens (256 + 300 = 556) must be <= model.max_seq_len (512)"),
        (["--optimizer.betas=[0.9]"], "optimizer.betas must be two numbers in [0, 1)"),
        (["--rl.reward=exact_match"], "rl.reward must be a built-in (math, choice"),
        (["--data.min_pixels=100000", "--data.max_pixels=12544"], "data.max_pixels (12544) must be >= data.min_pixels (100000)"),
        (["--data.max_pixels=0"], "data.max_pixels must be >= 1, got 0"),
        (["--parallelism.data_parallel_shard_degree=0"], "must be -1 (all ranks) or >= 1"),
        (["--rollout.temperature=0"], "rollout.temperature must be > 0 for rl.algorithm='grpo'"),
        (["--job.name=a/b"], "job.name must be a plain folder name"),
        (["--checkpoint.keep_latest_k=1"], "checkpoint.keep_latest_k must be 0 (keep all) or >= 2, got 1"),
    ],
)
def test_validation_messages(tokens, expected):
    assert expected in config_error(*tokens)


def test_all_problems_are_reported_together():
    message = config_error("--optimizer.lr=0", "--checkpoint.interval=0")
    assert message.startswith("config error: 2 problems:")
    assert "optimizer.lr must be > 0" in message and "checkpoint.interval must be > 0" in message


def test_ppo_needs_no_group_and_the_model_path_may_be_empty():
    assert load_config(None, ["--rl.algorithm=ppo", "--rollout.n=1"]).rl.algorithm == "ppo"
    assert "rollout.n must be >= 2 for rl.algorithm='grpo'" in config_error("--rollout.n=1")
    assert load_config(REPO / "configs" / "qwen2_5_vl_7b.toml").model.path == ""


def test_validate_world_size():
    cfg = overridden("--rl.global_batch_size=4", "--rollout.n=2", "--parallelism.ulysses=fixed",
                     "--parallelism.ulysses_degree=3")  # fmt: skip
    with pytest.raises(ConfigError) as info:
        cfg.validate_world_size(16)
    assert "ulysses_degree (3) must divide the number of ranks (16)" in str(info.value)
    assert "8 sequences, fewer than the 16 data-parallel ranks" in str(info.value)
    JobConfig().validate_world_size(2)


def test_a_shard_degree_below_the_ranks_is_odc_hybrid_sharding_only():
    """parallelism.data_parallel_shard_degree below the ranks: hybrid sharding, which only odc runs (colocated);
    elsewhere refused with the reason. Shard groups must be one machine's consecutive ranks (torchrun's agents)."""
    from titanrl.memory import shard_groups_problem

    overridden("--balance.strategy=odc", "--parallelism.data_parallel_shard_degree=2").validate_world_size(4)
    for flags, world, why in (
            (["--parallelism.data_parallel_shard_degree=2"], 4, "built for balance.strategy='odc' only"),
            (["--balance.strategy=odc", "--parallelism.data_parallel_shard_degree=3"], 4, "must divide the number"),
            (["--balance.strategy=odc", "--parallelism.data_parallel_shard_degree=8"], 4, "must divide the number"),
            (["--balance.strategy=odc", "--parallelism.data_parallel_shard_degree=1", "--workflow.placement=disaggregated",
              "--workflow.rollout_ranks=1"], 3, "workflow.placement='colocated' only")):
        with pytest.raises(ConfigError, match=re.escape(why)):
            overridden(*flags).validate_world_size(world)
    assert shard_groups_problem(2, [0, 0, 1, 1]) is None and shard_groups_problem(4, [0, 0, 0, 0]) is None
    assert "ranks 2-3 span machines [0, 1]" in shard_groups_problem(2, [0, 0, 0, 1])
    assert "does not divide" in shard_groups_problem(3, [0, 0, 1, 1])
    # the one rule the trainer, the memory CLI and HetRL's cost model apply (titanrl.memory.fsdp_shard_degree)
    from titanrl.memory import fsdp_shard_degree

    odc = overridden("--balance.strategy=odc")
    assert fsdp_shard_degree(odc, [0, 0, 1, 1], disaggregated=False) == 2
    assert fsdp_shard_degree(odc, [0, 0, 0, 0], disaggregated=False) == 4
    assert fsdp_shard_degree(overridden(), [0, 0, 1, 1], disaggregated=False) == 4  # lb_mini: not hybrid
    for machines, disaggregated, why in (([0, 0, 1, 1], True, "built for workflow.placement='colocated'"),
                                         ([0, 0, 0, 1], False, "as many training ranks on every machine"),
                                         ([0, 1, 0, 1], False, "ranks 0-1 span machines [0, 1]")):
        with pytest.raises(ConfigError, match=re.escape(why)):
            fsdp_shard_degree(odc, machines, disaggregated=disaggregated)


# ---------------------------------------------------------------- printing, saving, round trip


@pytest.mark.parametrize("path", SHIPPED_CONFIGS, ids=lambda p: p.name)
def test_round_trip_through_saved_toml(path, tmp_path):
    overrides = ["--lr_scheduler.decay_steps=7", '--job.description=tab\there "quoted" é \x7f']
    cfg = load_config(path, overrides)
    saved = save_resolved(cfg, tmp_path / "out" / "resolved.toml")
    assert load_config(saved) == cfg
    assert config_from_dict(tomllib.loads(config_to_toml(cfg, with_docs=False))) == cfg


def test_round_trip_through_dict_and_json():
    cfg = overridden("--rollout.seed=3", "--compile.components=[loss]")
    data = config_to_dict(cfg)
    assert config_from_dict(json.loads(json.dumps(data))) == cfg
    assert data["rollout"]["seed"] == 3 and data["lr_scheduler"]["decay_steps"] is None


def test_printed_toml_is_readable(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["--print-config", "--rollout.n=5"])
    assert info.value.code == 0
    printed = capsys.readouterr().out
    assert "[rollout]\n" in printed and "n = 5\n" in printed
    assert "# Responses sampled per prompt" in printed  # field docs become comments
    assert "ray_object_store_bytes = 268_435_456" in printed
    assert config_from_dict(tomllib.loads(printed)) == overridden("--rollout.n=5")


def test_help_lists_every_key_with_type_value_and_doc(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["--config", str(REPO / "configs" / "small_cpu.toml"), "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for key in all_keys(JobConfig):
        toml_only = table_list_of(lookup(JobConfig, key, "")[1].type) is not None  # no --key for [[tables]]
        assert f"  {'' if toml_only else '--'}{key}: " in text, key
    assert '--model.flavor: one of \'tiny\', \'small\', \'none\' = "small"' in text
    assert "--lr_scheduler.decay_steps: int or none = none" in text
    assert "Responses sampled per prompt" in text
    assert "--job.name" in format_help(JobConfig())


def test_run_paths():
    cfg = overridden("--job.dump_folder=/tmp/o", "--job.name=r1", "--checkpoint.folder=ck")
    assert cfg.run_dir == Path("/tmp/o/r1") and cfg.checkpoint_dir == Path("/tmp/o/r1/ck")
    assert overridden("--checkpoint.folder=/abs/ck").checkpoint_dir == Path("/abs/ck")


# ---------------------------------------------------------------- property: random overrides


def _value_strategy(tp: Any) -> st.SearchStrategy:
    inner = optional_inner(tp)
    if inner is not None:
        return st.none() | _value_strategy(inner)
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.integers(-(2**62), 2**62)
    if tp is float:
        return st.floats(allow_nan=False, allow_infinity=False)
    if tp is str:
        return st.text(max_size=20)
    if typing.get_origin(tp) is Literal:
        return st.sampled_from(typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return st.lists(_value_strategy(typing.get_args(tp)[0]), max_size=4)
    raise AssertionError(tp)


def _toml_string(text: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped (JSON's escapes are not TOML's for
    characters past the BMP, and JSON leaves DEL raw, which TOML refuses)."""
    escaped = "".join(f"\\u{ord(c):04X}" if ord(c) < 0x20 or ord(c) == 0x7F else "\\" + c if c in '"\\' else c
                      for c in text)
    return f'"{escaped}"'


def _as_tokens(key: str, value: Any, spaced: bool) -> list[str]:
    """How a user would type ``value`` for ``key``."""
    if isinstance(value, bool):
        return [f"--{key}"] if value else [f"--no-{key}"]
    if value is None:
        text = "none"
    elif isinstance(value, list):
        text = "[" + ", ".join(_toml_string(v) if isinstance(v, str) else json.dumps(v) for v in value) + "]"
    elif isinstance(value, float):
        text = repr(value)
    else:
        text = str(value)
    if spaced and not text.startswith("--"):
        return [f"--{key}", text]
    return [f"--{key}={text}"]


# arrays of tables ([[workflow.nodes]]) are set in TOML files only: tests/test_workflow.py covers them
_KEY_TYPES = {key: lookup(JobConfig, key, "")[1].type for key in all_keys(JobConfig)
              if table_list_of(lookup(JobConfig, key, "")[1].type) is None}


@st.composite
def _random_overrides(draw) -> dict[str, Any]:
    keys = draw(st.lists(st.sampled_from(sorted(_KEY_TYPES)), unique=True, max_size=8))
    return {key: draw(_value_strategy(_KEY_TYPES[key])) for key in keys}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=_random_overrides(), spaced=st.booleans())
def test_random_overrides_apply_and_round_trip(values, spaced):
    tokens = [t for key, value in values.items() for t in _as_tokens(key, value, spaced)]
    cfg = load_config(None, tokens, validate=False)
    for key, value in values.items():
        assert _get(cfg, key.split(".")) == value, key
    reloaded = config_from_dict(tomllib.loads(config_to_toml(cfg)))
    assert reloaded == cfg
    assert dataclasses.asdict(reloaded) == dataclasses.asdict(cfg)


# ---------------------------------------------------------------- helpers


def _get(cfg: Any, path: list[str]) -> Any:
    for part in path:
        cfg = getattr(cfg, part)
    return cfg


def _flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
