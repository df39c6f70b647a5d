"""Entry point: ``python -m titanrl.train --config configs/X.toml [--section.key=value ...]``,
or the same under ``torchrun --nproc-per-node N -m titanrl.train ...``.

The config is parsed and validated before torch is imported: a typo in a key costs
milliseconds and a clear message (exit code 2), not a model load.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from titanrl.config import config_to_toml, parse_args_or_exit

    cfg = parse_args_or_exit(sys.argv[1:] if argv is None else argv)

    import os

    if int(os.environ.get("RANK", "0")) == 0:
        print("[titanrl] resolved config:\n" + config_to_toml(cfg, with_docs=False), flush=True)

    from titanrl.config.errors import ConfigError
    from titanrl.distributed import init_distributed, shutdown
    from titanrl.trainer import Trainer

    info = init_distributed()
    try:
        try:
            trainer = Trainer(cfg, info)
        except ConfigError as err:  # a check that needs the world size or the model's shape
            if info.is_main:
                print(str(err), file=sys.stderr, flush=True)
            return 2
        if info.is_main:
            print(
                f"[titanrl] {info.world_size} rank(s) on {info.device.type}; model {trainer.model_dir}; "
                f"{len(trainer.records)} samples from {trainer.manifest}; run dir {cfg.run_dir}",
                flush=True,
            )
        trainer.train()
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
