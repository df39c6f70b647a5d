"""Every public module imports on its own: as the first titanrl module of an interpreter (a circular
import only shows then). One interpreter; titanrl's modules are dropped from ``sys.modules`` before
each import, third-party ones (torch, vLLM) stay loaded so the test is quick."""

from __future__ import annotations

import subprocess
import sys

_SCRIPT = r"""
import importlib, pkgutil, sys, traceback
import titanrl
names = sorted(m.name for m in pkgutil.walk_packages(titanrl.__path__, "titanrl."))
failed = []
for name in names:
    for loaded in [m for m in sys.modules if m == "titanrl" or m.startswith("titanrl.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ":\n" + traceback.format_exc(limit=4))
print(len(names), "modules")
if failed:
    print("\n".join(failed))
    sys.exit(1)
"""


def test_every_module_imports_first():
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert int(proc.stdout.split()[0]) > 50
