"""The product surface: ``python -m titanrl.train`` / torchrun, config errors, bad samples."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from train_runs import run, train_cmd

from titanrl.data.synth import generate_dataset


def run_train(tmp_path: Path, *overrides: str, nproc: int | None = None, cache: Path | None = None,
              env: dict[str, str] | None = None, own_ray: bool = False) -> subprocess.CompletedProcess:
    """Two steps of the tiny config, the run folder ``tmp_path/out/tiny_cpu``; the caller checks the outcome."""
    argv = train_cmd(tmp_path / "out", cache or tmp_path / "cache", "--job.steps=2", *overrides, nproc=nproc,
                     own_ray=own_ray)
    return run(argv, env=env, timeout=600, check=False)


def test_unknown_key_fails_fast_without_traceback(tmp_path):
    proc = run_train(tmp_path, "--optimizer.lrr=3", own_ray=True)
    assert proc.returncode == 2
    assert "did you mean 'optimizer.lr'" in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr
    # under torchrun every rank finds it; the console says it once (it said it per rank, written over each other)
    proc = run_train(tmp_path, "--optimizer.lrr=3", nproc=2, own_ray=True)
    lines = [x for x in (proc.stdout + proc.stderr).splitlines() if "optimizer.lrr" in x]
    assert proc.returncode != 0 and len(lines) == 1 and lines[0].startswith("config error: unknown key"), lines


def test_engine_sleep_on_a_cpu_is_refused_before_anything_is_built(tmp_path):
    """rollout.sleep = 'on' where it frees nothing (the CPU: host memory is the device) stops at start with the
    key and the fix, before a model, an engine or a loader is built."""
    proc = run_train(tmp_path, "--rollout.sleep=on", own_ray=True)
    assert proc.returncode == 2
    out = proc.stderr + proc.stdout
    assert "rollout.sleep = 'on'" in out and "set rollout.sleep = 'auto' or 'off'" in out
    assert "Traceback" not in proc.stderr and not (tmp_path / "cache").exists()


def test_single_process_run_writes_config_and_metrics(tmp_path, run_cache):
    # as a user runs it: no data.ray_address (a private Ray instance)
    proc = run_train(tmp_path, "--job.steps=3", "--metrics.log_freq=2", "--metrics.progress=line", cache=run_cache,
                     own_ray=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "out" / "tiny_cpu"
    assert (run_dir / "config.toml").is_file()
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [2, 3]  # every log_freq steps, and the last one
    assert "step 3/3" in proc.stdout and "step 1/3" not in proc.stdout
    # The console holds titanrl's lines only; vLLM's log (several lines per weight push) is in the rank's log.
    console = proc.stdout + proc.stderr
    vllm_line = re.compile(r"(INFO|WARNING|DEBUG) \d\d-\d\d \d\d:\d\d:\d\d \[")
    assert not vllm_line.search(console), vllm_line.search(console).group(0)
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert vllm_line.search(log) and "step 3/3" in log
    assert "Failed to load weights" not in log  # buffer-only layers: see vllm_engine._DerivedBufferFilter
    assert "[titanrl] done: steps 1-3" in proc.stdout and f"metrics    {run_dir / 'metrics.jsonl'}" in proc.stdout


@pytest.mark.slow
def test_single_process_bfloat16_computes_in_bfloat16(tmp_path, run_cache):
    """One process with model.dtype = bfloat16 (no torchrun): FSDP2 on a one-rank mesh applies the mixed-precision
    rule of many ranks -- float32 master parameters, forward in bfloat16 -- and the trainer's log-probs agree with
    the bfloat16 vLLM engine's at step 1 within bfloat16's rounding (2^-7). The bound holds on any CPU: the two
    bfloat16 computations differ by the kernels' accumulation order, measured 2e-4 (AVX-512 without bf16), 5.6e-4
    (no AVX-512) and 4e-3 (avx512_bf16, vLLM multiplying in bf16). No probe bound can tell a float32 trainer apart
    on every CPU (8e-4 from the engine on one of them); the compute dtype itself is asserted by
    test_fsdp_mixed_precision_computes_in_param_dtype."""
    import torch

    from titanrl.rl.dump import load_dumps

    proc = run_train(tmp_path, "--model.dtype=bfloat16", "--metrics.dump_tensors=true", "--checkpoint.enable=false",
                     cache=run_cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "out" / "tiny_cpu"
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2]
    assert 0 < steps[0]["probe/logprob_max_diff"] < 2.0 ** -7, steps[0]["probe/logprob_max_diff"]
    assert "compute bfloat16" in proc.stdout  # the trainer's own line on what it built (see the probe test)
    params = load_dumps(run_dir)[2]["params"]["policy"]
    assert {t.dtype for t in params.values()} == {torch.float32}  # the master weights the optimizer updates


DTYPE_PROBE = """
import sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from titanrl.models.packed import pack_sequences
from titanrl.models.qwen2_5_vl import Qwen2_5_VLArgs
from titanrl.models.qwen2_5_vl.inputs import make_sequence_input
from titanrl.parallel.parallelize import build_parallel_model

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
args = Qwen2_5_VLArgs.from_pretrained(sys.argv[1])
for dtype in (torch.bfloat16, torch.float32):
    model = build_parallel_model(args, sys.argv[1], device=torch.device("cpu"), dp_mesh=mesh, param_dtype=dtype)
    masters = sorted({str(p.dtype) for p in model.parameters()})  # before a forward unshards the root's
    seen = set()
    hooks = [m.register_forward_hook(lambda m, i, o: seen.add((str(i[0].dtype), str(m.weight.dtype), str(o.dtype))))
             for m in model.modules() if isinstance(m, torch.nn.Linear)]
    batch = pack_sequences([make_sequence_input(args, torch.arange(5, 21).numpy(), [], None)])
    model(batch)
    print(str(dtype), sorted(seen), masters)
dist.destroy_process_group()
"""


def test_fsdp_mixed_precision_computes_in_param_dtype(tiny_ckpt):
    """The trainer's build (``build_parallel_model``, FSDP2 on a one-rank mesh) with param_dtype bfloat16: every
    linear layer of a forward multiplies bfloat16 inputs by bfloat16 weights while the parameters stay float32;
    with float32, float32 throughout."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", DTYPE_PROBE, str(tiny_ckpt)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    bf16, fp32 = proc.stdout.strip().splitlines()[-2:]
    assert bf16 == "torch.bfloat16 [('torch.bfloat16', 'torch.bfloat16', 'torch.bfloat16')] ['torch.float32']", bf16
    assert fp32 == "torch.float32 [('torch.float32', 'torch.float32', 'torch.float32')] ['torch.float32']", fp32


@pytest.fixture()
def corrupt_manifest(tmp_path):
    manifest = generate_dataset(tmp_path / "data", "only-video", 4, seed=1)
    first = json.loads(manifest.read_text().splitlines()[0])
    (manifest.parent / first["media"][0]["path"]).write_bytes(b"\x00not a video")
    return manifest, first["id"]


def test_corrupt_video_is_skipped_and_counted(tmp_path, corrupt_manifest, run_cache):
    manifest, bad_id = corrupt_manifest
    proc = run_train(tmp_path, f"--data.manifest={manifest}", "--data.on_bad_sample=skip", "--job.steps=1",
                     "--rl.global_batch_size=4", cache=run_cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"skipping sample {bad_id!r}" in proc.stdout
    metrics = json.loads((tmp_path / "out" / "tiny_cpu" / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["data/skipped"] == 1


def test_corrupt_video_is_an_error_naming_the_sample(tmp_path, corrupt_manifest, run_cache):
    manifest, bad_id = corrupt_manifest
    proc = run_train(tmp_path, f"--data.manifest={manifest}", "--data.on_bad_sample=error", "--job.steps=1",
                     cache=run_cache)
    assert proc.returncode != 0
    assert bad_id in proc.stderr and "Traceback" not in proc.stderr + proc.stdout  # the traceback is in the log
    assert "Traceback" in (tmp_path / "out" / "tiny_cpu" / "logs" / "rank0.log").read_text()


def test_a_file_that_kills_the_decoder_is_skipped_and_counted(tmp_path, run_cache):
    """The preprocessor process dies decoding one file (SIGSEGV, as in a crash inside FFmpeg); Ray
    restarts it, the crash journal names the sample, and the run skips and counts it."""
    from titanrl.data.shadow.preprocessor import FAULT_DECODE_CRASH_ENV

    manifest = generate_dataset(tmp_path / "data", "only-video", 4, seed=1)
    first = json.loads(manifest.read_text().splitlines()[0])
    name = Path(first["media"][0]["path"]).name
    proc = run_train(tmp_path, f"--data.manifest={manifest}", "--data.on_bad_sample=skip", "--job.steps=1",
                     "--rl.global_batch_size=4", cache=run_cache, env={FAULT_DECODE_CRASH_ENV: name},
                     own_ray=True)  # the preprocessor inherits the fault's variable from rank 0
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next((l for l in proc.stdout.splitlines() if "skipping sample" in l), "")
    assert f"skipping sample {first['id']!r}: decoder_crash" in line and name in line, proc.stdout[-3000:]
    metrics = json.loads((tmp_path / "out" / "tiny_cpu" / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["data/skipped"] == 1


LOCK_PROBE_REWARD = '''
import os
from pathlib import Path

from titanrl.config.errors import ConfigError
from titanrl.rl.rewards import exact_match_with_format
from titanrl.run_lock import check_free


def reward(response, record):
    # called by the live run's reward worker (another process): does the run hold its own folder?
    out = Path(os.environ["LOCK_PROBE_OUT"])
    if not out.exists():
        try:
            check_free(Path(os.environ["LOCK_PROBE_DIR"]))
            seen = "free"
        except ConfigError as err:
            seen = str(err)
        out.with_suffix(".tmp").write_text(seen)
        out.with_suffix(".tmp").rename(out)
    return exact_match_with_format(response, record)
'''


@pytest.mark.slow
@pytest.mark.serial
def test_a_live_run_holds_its_folder_and_a_second_run_there_stops_at_once(tmp_path, run_cache):
    """While a run is training, its folder is held (seen from its own reward worker, another process); a second
    run (2 ranks) given the same folder stops in seconds with exit 2 and one line naming the folder and the live run's pid,
    before it writes anything there; once the live run is killed (-9), the folder is free again (the kernel drops
    the lock with the process: no stale lock)."""
    import os
    import signal
    import time

    from train_runs import run_env

    from titanrl.config.errors import ConfigError
    from titanrl.run_lock import check_free, hold

    (tmp_path / "lock_probe.py").write_text(LOCK_PROBE_REWARD)
    run_dir, probe = tmp_path / "out" / "tiny_cpu", tmp_path / "probe.txt"
    env = {"PYTHONPATH": str(tmp_path), "LOCK_PROBE_DIR": str(run_dir), "LOCK_PROBE_OUT": str(probe)}
    live = subprocess.Popen(train_cmd(tmp_path / "out", run_cache, "--job.steps=200", "--checkpoint.enable=false",
                                      "--rl.reward=lock_probe:reward"),
                            env=run_env(env), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not probe.exists() and live.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert probe.exists(), f"the live run never scored a response (exit {live.poll()})"
        held = probe.read_text()
        assert f"the run folder {run_dir} is in use by a live run (pid {live.pid} on " in held, held
        logs = sorted(p.name for p in (run_dir / "logs").iterdir())
        assert logs == ["rank0.log"]  # the second run has 2 ranks: writing there, it would add rank1.log
        t0 = time.monotonic()
        second = run(train_cmd(tmp_path / "out", run_cache, "--job.steps=2", nproc=2), check=False, timeout=120,
                     fresh=True)  # torchrun's own summary of the exit (below)
        assert time.monotonic() - t0 < 30
        console = second.stdout + second.stderr
        # its first rank exits 2 (a config error), torchrun ends the other and reports that exit
        assert second.returncode != 0 and "failed (exitcode: 2) local_rank: 0" in console, console[-3000:]
        lines = [x for x in console.splitlines() if "in use by a live run" in x]
        assert len(lines) == 1 and f"pid {live.pid} on " in lines[0] and "--job.dump_folder or --job.name" in lines[0]
        assert "titanrl/" not in console  # no traceback of ours (torchrun prints its own)
        assert sorted(p.name for p in (run_dir / "logs").iterdir()) == logs and live.poll() is None
    finally:
        os.killpg(live.pid, signal.SIGKILL)
        live.wait()
    check_free(run_dir)  # nothing holds it any more
    with hold(run_dir), pytest.raises(ConfigError, match="in use by a live run"):
        check_free(run_dir)  # another open of the file, in this process, sees the hold too


@pytest.mark.slow
def test_chat_datasets_train_through_data_path(tmp_path, run_cache):
    """A folder holding a chat JSONL with the images inside the messages and one in the messages + images layout
    trains 2 steps through --data.path, its format told apart by its keys (no data.format)."""
    from test_formats import _chat_rows

    synth = generate_dataset(tmp_path / "synth", "image-heavy", 8, seed=3)
    folder = tmp_path / "chat"
    folder.mkdir()
    for inline in (True, False):
        # the videos are named relative to the file's folder: the file sits beside the synthetic set's folder
        written = _chat_rows(synth, synth.parent.parent / f"{'inline' if inline else 'columns'}.jsonl", inline)
        text = written.read_text().replace(f'"{synth.parent.name}/', f'"{synth.parent}/')
        if not inline:  # the same samples again: other ids (a repeated id is a bad row)
            text = text.replace('"id": "', '"id": "columns-')
        (folder / written.name).write_text(text)
    proc = run_train(tmp_path, f"--data.path={folder}", "--rl.global_batch_size=4", "--checkpoint.enable=false",
                     cache=run_cache)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    assert f"data.path {str(folder)!r}: 16 samples from 16 rows" in proc.stdout, proc.stdout[-3000:]
    assert "step 2/2" in proc.stdout
