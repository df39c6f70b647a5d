#!/usr/bin/env bash
# Wheels for a CUDA machine that has PyTorch, transformers' dependencies and a GPU but no package index:
# what titanrl imports beyond such an image (checked on a torch 2.11 / Python 3.12 image), for Python 3.12 on
# x86-64, into DIR (default .whl, git-ignored). There:
#
#   python3 -m pip install --no-index --no-deps --target /tmp/site DIR/*.whl && export PYTHONPATH=/tmp/site
#   bash scripts/check_gpu.sh OUT_DIR
#
# vLLM (and the torch it pins) and Ray are too large to carry this way: without them scripts/check_gpu.py uses
# rollout.engine = "hf" and data.loader = "centralized", and says so in its report.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
mkdir -p "$DIR"
version() { python3 -c "import importlib.metadata as m; print(m.version('$1'))"; }
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DIR" \
    "torchtitan==$(version torchtitan)" "torchdata==$(version torchdata)" "av==$(version av)" \
    "math-verify==$(version math-verify)" "latex2sympy2_extended==$(version latex2sympy2_extended)" \
    "antlr4-python3-runtime==$(version antlr4-python3-runtime)" "tyro==$(version tyro)" \
    "spmd_types==$(version spmd_types)" "docstring_parser==$(version docstring_parser)" "dill==$(version dill)" \
    "transformers==$(version transformers)"
du -sh "$DIR"
