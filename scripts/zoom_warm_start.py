"""A format warm start for the zoom task's learning curve: the tiny random-init checkpoint taught *how* to reply,
not *what* (``benchmarks/learning_curve_zoom.md``).

    python scripts/zoom_warm_start.py OUT --seed 0     # -> OUT: an HF checkpoint for --model.path

A random-init policy over a 1024-token vocabulary never writes a 25-token ``<zoom>x0,y0,x1,y1</zoom>`` call, so RL
alone cannot find the tool; a real policy starts from an instruction-tuned model that knows the call's syntax (the
multi-turn RL papers add a "cold start" of supervised tool calls). This is that cold start, at the tiny scale: a
few supervised steps on the zoom task's own prompts (with their first-view image), each answered with the zoom call
on the square the prompt names, followed by the tool's answer (the enlarged square, as a multi-turn rollout appends
it) and a colour word (share ``--call-share``), or with a colour word at once; every colour word drawn at random,
independent of the picture. The warm-started policy therefore calls the tool about as often as it answers and its
answers are at chance; what RL then has to learn is to prefer the call and to read the colour in what the tool
returns. Cross entropy on the response tokens and the end-of-turn token, AdamW, one process.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--seed", type=int, default=0, help="job.seed of the runs: the random checkpoint and data")
    p.add_argument("--samples", type=int, default=256, help="how many of the runs' prompts (the first N) it trains on")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--call-share", type=float, default=0.5)
    p.add_argument("--cache", default="~/.cache/titanrl")
    opts = p.parse_args()

    import tempfile

    import torch

    from titanrl.data.manifest import read_manifest
    from titanrl.data.preprocess import MediaSettings, decode_media, media_to_patches
    from titanrl.data.prompt import PromptEncoder
    from titanrl.data.synth import ANSWER_CHOICES, generate_dataset
    from titanrl.data.synth_formats import ZOOM_TARGET
    from titanrl.envs import check_step, env_record
    from titanrl.envs.zoom import ZoomEnv
    from titanrl.assets import tiny_checkpoint
    from titanrl.models.packed import pack_sequences
    from titanrl.models.qwen2_5_vl import Qwen2_5_VLArgs
    from titanrl.models.qwen2_5_vl.inputs import make_sequence_input
    from titanrl.models.qwen2_5_vl.model import LogprobTargets
    from titanrl.parallel.parallelize import build_parallel_model
    from titanrl.rl.turns import observation_tokens
    from titanrl.rl.weight_sync import write_hf

    torch.manual_seed(opts.seed)
    ckpt = tiny_checkpoint(opts.cache, "tiny", opts.seed)  # the runs' own (model.cache_dir)
    args = Qwen2_5_VLArgs.from_pretrained(ckpt)
    model = build_parallel_model(args, ckpt, device=torch.device("cpu"), dp_mesh=None, seed=opts.seed)
    encoder = PromptEncoder.from_pretrained(ckpt)
    settings = MediaSettings.from_checkpoint(ckpt, fps=2.0, max_frames=8)
    end = int(encoder.tokenizer.convert_tokens_to_ids("<|im_end|>"))
    call_text = "<zoom>{},{},{},{}</zoom>".format(*ZOOM_TARGET)
    call = list(encoder.encode_text(call_text))
    colours = [list(encoder.encode_text(c)) for c in ANSWER_CHOICES]
    with tempfile.TemporaryDirectory() as tmp:
        manifest = generate_dataset(tmp, "zoom", opts.samples, seed=opts.seed)
        samples = []  # per prompt: (first turn: ids, grids, pixels), (after the call: observation ids, grid, pixels)
        for record in read_manifest(manifest):
            (first,) = decode_media(record, manifest.parent, settings)
            pixels, grid = media_to_patches(first, settings)
            step = check_step(ZoomEnv(env_record(record, manifest.parent)).step(call_text), max_images=1)
            obs, _, obs_grids, obs_pixels = observation_tokens(encoder, settings, step, "<|im_end|>")
            samples.append((list(encoder.encode(record.prompt, [grid])), grid, pixels, list(obs), obs_grids[0],
                            obs_pixels))
    rng = np.random.default_rng(opts.seed)
    optim = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=opts.lr, weight_decay=0.0)
    for step in range(opts.steps):
        seqs, positions, targets, offset = [], [], [], 0
        for i in rng.integers(len(samples), size=opts.batch):
            ids, grid, pixels, obs, obs_grid, obs_pixels = samples[i]
            answer = colours[int(rng.integers(len(colours)))] + [end]
            if rng.random() < opts.call_share:  # the call, the tool's answer, then a colour word
                full = ids + call + [end] + obs + answer
                scored = [(len(ids), len(call) + 1), (len(ids) + len(call) + 1 + len(obs), len(answer))]
                seqs.append(make_sequence_input(args, full, [grid, obs_grid],
                                                torch.from_numpy(np.concatenate([pixels, obs_pixels]))))
            else:  # a colour word at once
                full, scored = ids + answer, [(len(ids), len(answer))]
                seqs.append(make_sequence_input(args, full, [grid], torch.from_numpy(pixels)))
            for start, length in scored:
                positions += [offset + start - 1 + k for k in range(length)]
                targets += full[start:start + length]
            offset += len(full)
        batch = pack_sequences(seqs).to(torch.device("cpu"), torch.float32)
        out = model(batch, LogprobTargets(torch.tensor(positions), torch.tensor(targets)))
        loss = -out.logprobs.mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        if step % 20 == 0 or step == opts.steps - 1:
            print(f"step {step}: loss {loss.item():.3f}", flush=True)
    write_hf(model, args, Path(opts.out), dtype=None, writer_rank=True, assets_from=ckpt)
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
