"""Binding node ids to functions: a built-in name (``titanrl.rl.nodes``), ``package.module:function`` or
``path/to/file.py:function``. A function that cannot be found is a ConfigError naming the node, raised before
any model or engine is built."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import zlib
from pathlib import Path
from typing import Callable

from titanrl.config.errors import ConfigError
from titanrl.workflow.graph import NodeSpec, Workflow


def load_function(spec: str, what: str) -> Callable:
    """``module:function`` or ``file.py:function`` (a path relative to the working directory; ``function`` may be
    dotted: ``Class.method``); ``what`` names the config key or node in errors. The one resolver of user code:
    workflow nodes and ``rl.reward``."""
    target, _, name = spec.rpartition(":")
    if target.endswith(".py"):
        path = Path(target).expanduser()
        if not path.is_file():
            raise ConfigError(f"{what}: {spec!r}: no file {path.resolve()}")
        # the same name in every process and run (checkpoints pickle rl.env's environments by it)
        module_name = f"titanrl_user_{path.stem}_{zlib.crc32(str(path.resolve()).encode()):08x}"
        module = sys.modules.get(module_name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[module_name] = module
            try:
                loader_spec.loader.exec_module(module)
            except Exception as err:
                del sys.modules[module_name]
                raise ConfigError(f"{what}: {spec!r}: importing {path} failed: {type(err).__name__}: {err}") from err
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as err:
            raise ConfigError(f"{what}: {spec!r}: cannot import module {target!r} ({err})") from err
    fn = module
    for part in name.split("."):  # module:Class.method too
        fn = getattr(fn, part, None)
        if fn is None:
            raise ConfigError(f"{what}: {spec!r}: {target!r} has no {name!r}")
    if not callable(fn):
        raise ConfigError(f"{what}: {spec!r} is not callable")
    return fn


def bind(workflow: Workflow) -> dict[str, Callable]:
    """Node id -> the function it runs."""
    from titanrl.rl import nodes as builtin

    out = {}
    for node in workflow.nodes:
        out[node.id] = (getattr(builtin, node.function) if node.builtin
                        else load_function(node.function, f"workflow node {node.id!r}"))
    return out


def node_of(workflow: Workflow, node_id: str) -> NodeSpec:
    return workflow.node(node_id)
