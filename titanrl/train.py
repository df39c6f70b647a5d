"""Entry point: ``python -m titanrl.train --config configs/X.toml [--section.key=value ...]``,
or the same under ``torchrun --nproc-per-node N -m titanrl.train ...``.

The config is parsed and validated before torch is imported: a typo in a key costs
milliseconds and a clear message (exit code 2), not a model load. Then, unless
``metrics.verbose``, every rank's own output goes to ``<run dir>/logs/rank<N>.log`` and the console
keeps titanrl's lines only (``titanrl.console``).
"""

from __future__ import annotations

import os
import sys
import time

# Errors a user causes and fixes without reading our code: one named line on the console, the
# traceback in the rank's log. Anything else is a bug of ours and shows its traceback.
_USER_ERRORS = (
    "titanrl.config.errors.ConfigError",
    "titanrl.data.shadow.types.BadSampleError",
    "titanrl.data.shadow.types.DataUnavailableError",
    "titanrl.data.manifest.ManifestError",
    "titanrl.data.media.MediaError",
    "titanrl.rl.timing.CollectiveError",
    "titanrl.rl.reward_runner.RewardError",
    "titanrl.envs.EnvError",
    "titanrl.checkpoint.CheckpointError",
)


# Errors every rank raises alike (a DCP checkpoint's load or save fails on all of them): one console line, rank 0's
_EVERY_RANK = ("titanrl.checkpoint.CheckpointError",)


def _is_a(err: BaseException, names: tuple[str, ...]) -> bool:
    """Whether ``err`` is an instance of one of the classes named (module.qualname; their modules are not imported
    here)."""
    return any(f"{c.__module__}.{c.__qualname__}" in names for c in type(err).__mro__)


def _is_user_error(err: BaseException) -> bool:
    if _is_a(err, ("titanrl.workflow.executor.NodeError",)):  # the user's own function, or one of the errors above
        node = err.node
        return not node.builtin or node.role == "reward" or _is_user_error(err.cause)
    return _is_a(err, _USER_ERRORS)


def _speaks_for_host(info) -> bool:
    """Whether this rank writes the console line of an error every rank met: rank 0, and the first rank of each
    other host."""
    from titanrl.workflow.abort import shows_cause

    return info.is_main or shows_cause(info.rank, info.local_rank, 0)


def _end_together(info) -> None:
    """After an error every rank met: the host's speaker says its line is written; the host's other ranks wait for
    it (``titanrl.workflow.abort.wait_for_the_speaker``)."""
    from titanrl.workflow.abort import said, wait_for_the_speaker

    host = info.rank - info.local_rank
    if _speaks_for_host(info):
        said(host)
    else:
        wait_for_the_speaker(host)


def main(argv: list[str] | None = None) -> int:
    started = time.time()
    from titanrl.config import parse_args_or_exit
    from titanrl.console import log_path, refuse, report_exception, route_output, say

    cfg = parse_args_or_exit(sys.argv[1:] if argv is None else argv)
    rank = int(os.environ.get("RANK", "0"))
    from titanrl._platform_compat import DIE_WITH_PARENT_ENV, start_up_problem

    if problem := start_up_problem():  # else vLLM's import fails later, naming torchvision
        return refuse(problem)

    # every process this rank starts (vLLM's engine core and its workers, reward workers, compile workers) and theirs
    # die with it, also when it is killed with -9 (the start-up hook arms the parent-death signal)
    os.environ[DIE_WITH_PARENT_ENV] = "1"
    from titanrl.config.errors import ConfigError
    from titanrl.run_lock import check_free

    try:  # before this run writes anything there (its logs): another live run may own the folder
        check_free(cfg.run_dir)
    except ConfigError as err:
        return refuse(str(err))
    if not cfg.metrics.verbose:
        route_output(cfg.run_dir / "logs", rank)
    if rank == 0:
        say(f"[titanrl] config: {cfg.run_dir / 'config.toml'} (the resolved config; add --print-config to print it "
            "and exit)")
        if log_path() is not None:
            say(f"[titanrl] third-party output (vLLM, Ray, torch) goes to {log_path().parent}/rank<N>.log; "
                "--metrics.verbose=true shows it here")

    from titanrl.distributed import init_distributed, shutdown

    # one process in bfloat16 (or offloading the reference): a one-rank group, so FSDP2 and its mixed-precision
    # policy apply as on many ranks
    info = init_distributed(cfg.job.collective_timeout_s, one_rank_group=cfg.one_rank_fsdp)
    trainer = None
    try:
        from titanrl.trainer import Trainer

        try:
            trainer = Trainer(cfg, info)
        except ConfigError as err:  # a check that needs the world size or the model's shape (every rank raises it)
            if _speaks_for_host(info):
                say(str(err), error=True)
            _end_together(info)
            return 2
        if info.is_main:
            dtype = str(trainer.param_dtype).removeprefix('torch.')
            lora = cfg.lora
            params = (f"LoRA rank {lora.rank}, alpha {lora.alpha:g}, on {', '.join(lora.targets)}"
                      f"{' and the vision blocks' if lora.vision else ''}: adapters float32"
                      f"{''.join(', ' + m for m in lora.modules_to_save)}{' in full, float32' if lora.modules_to_save else ''}"
                      f"; base frozen in {dtype}"
                      + ("" if trainer.ref_model is None else "; reference: the policy with its adapters off"
                         + (f" and the base's {', '.join(lora.modules_to_save)}" if lora.modules_to_save else ""))
                      if lora.enabled else "float32 parameters")
            say(f"[titanrl] {info.world_size} rank(s) on {info.device.type}; model {trainer.model_dir} (compute "
                f"{dtype}, {params}); "
                f"{len(trainer.records)} samples from {trainer.manifest}; run dir {cfg.run_dir}")
        trainer.train()
        if info.is_main:
            say(trainer.summary(time.time() - started))
    except Exception as err:  # noqa: BLE001 - the failing rank ends with a named line; see report_exception
        elsewhere = trainer.control.failed_elsewhere if trainer is not None else None
        if elsewhere is not None:  # a consequence of another rank's failure, whose line names the cause
            report_exception(err, rank=info.rank, expected=True, verbose=cfg.metrics.verbose, console=False)
            # the failing rank's own console line is on its host's console; a host without it shows the
            # cause once, from its first rank
            trainer.control.say_stopped()
        else:
            every = _is_a(err, _EVERY_RANK)
            report_exception(err, rank=info.rank, expected=_is_user_error(err), verbose=cfg.metrics.verbose,
                             console=_speaks_for_host(info) or not every)
            if every:
                _end_together(info)
        return 1
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
