"""``python -m titanrl.config [--config FILE] [overrides] [--help]``: print the resolved config.

Checks a config (and its overrides) without starting anything heavy; exit status 2 on a config
error, like the trainer's entry point.
"""

from __future__ import annotations

import sys

from titanrl.config.loader import parse_args_or_exit
from titanrl.config.serialize import config_to_toml


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args_or_exit(sys.argv[1:] if argv is None else argv)
    print(config_to_toml(cfg), end="")


if __name__ == "__main__":
    main()
