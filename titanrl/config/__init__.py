"""titanrl's job configuration: typed sections, TOML files, command-line overrides, validation.

Import-light on purpose (standard library only): the entry point parses and validates the config
before torch or anything heavy is imported.

    cfg = parse_args(sys.argv[1:])          # --config FILE.toml --section.key=value ...
    cfg = load_config("configs/tiny_cpu.toml", ["--rollout.n=8"])
    save_resolved(cfg, cfg.run_dir / "config.toml")
"""

from titanrl.config.errors import ConfigError
from titanrl.config.job_config import (
    BalanceConfig,
    CheckpointConfig,
    CompileConfig,
    DataConfig,
    JobConfig,
    JobRunConfig,
    LRSchedulerConfig,
    MetricsConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    RLConfig,
    RolloutConfig,
)
from titanrl.config.loader import (
    apply_overrides,
    config_from_dict,
    load_config,
    parse_args,
    parse_args_or_exit,
)
from titanrl.config.serialize import config_to_dict, config_to_toml, save_resolved

__all__ = [
    "ConfigError",
    "JobConfig",
    "JobRunConfig",
    "ModelConfig",
    "DataConfig",
    "ParallelismConfig",
    "BalanceConfig",
    "RolloutConfig",
    "RLConfig",
    "OptimizerConfig",
    "LRSchedulerConfig",
    "CheckpointConfig",
    "MetricsConfig",
    "CompileConfig",
    "parse_args",
    "parse_args_or_exit",
    "load_config",
    "config_from_dict",
    "apply_overrides",
    "config_to_dict",
    "config_to_toml",
    "save_resolved",
]
