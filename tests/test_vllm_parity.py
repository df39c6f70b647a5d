"""titanrl's model scores vLLM's sampled tokens exactly as vLLM did (fp32), for text, an image
and a video. This is the rollout/trainer agreement GRPO depends on; the video case only holds
because titanrl uses vLLM's rule for the positions of text after a video."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from titanrl.data.preprocess import DecodedMedia, MediaSettings, media_to_patches
from titanrl.models.packed import pack_sequences
from titanrl.models.qwen2_5_vl import Qwen2_5_VLArgs, Qwen2_5_VLModel, load_hf_weights
from titanrl.models.qwen2_5_vl.inputs import make_sequence_input
from titanrl.models.qwen2_5_vl.model import LogprobTargets
from vllm_probe import probe_image, probe_video, probe_video_metadata

TOL = 1e-4


@pytest.mark.slow
def test_titanrl_logprobs_equal_vllm(tiny_ckpt, vllm_probe_results):
    args = Qwen2_5_VLArgs.from_pretrained(tiny_ckpt)
    model = Qwen2_5_VLModel(args)
    load_hf_weights(model, tiny_ckpt)
    model.eval()
    video = probe_video()
    settings = MediaSettings.from_checkpoint(tiny_ckpt, fps=2.0, max_frames=len(video))
    media = {
        "text": [],
        "image": [DecodedMedia("image", probe_image()[None])],
        "video": [DecodedMedia("video", video, probe_video_metadata(len(video))["fps"])],
    }
    seqs, spans = [], []
    for name, items in media.items():
        result = vllm_probe_results[name]
        prompt, completion = result["prompt_token_ids"], result["token_ids"]
        patches = [media_to_patches(m, settings) for m in items]
        grids = [g for _, g in patches]
        pixels = torch.from_numpy(np.concatenate([p for p, _ in patches])) if patches else None
        seqs.append(make_sequence_input(args, prompt + completion, grids, pixels))
        spans.append((len(prompt), len(completion)))
    batch = pack_sequences(seqs)
    positions, offset = [], 0
    for seq, (n_prompt, n_completion) in zip(seqs, spans):
        positions.append(np.arange(offset + n_prompt - 1, offset + n_prompt - 1 + n_completion))
        offset += len(seq)
    pos = torch.from_numpy(np.concatenate(positions))
    with torch.no_grad():
        out = model(batch, LogprobTargets(positions=pos, token_ids=batch.input_ids[pos + 1]))
    ours = torch.split(out.logprobs, [n for _, n in spans])
    for name, mine in zip(media, ours):
        ref = torch.tensor(vllm_probe_results[name]["logprobs"])
        err = (mine - ref).abs().max().item()
        print(f"{name}: {len(ref)} tokens, max |titanrl - vLLM| log-prob {err:.2e}")
        assert err < TOL, f"{name}: {err:.2e}"

    # The check has teeth: with transformers 5's rule (text after a video resumes at the video's
    # start + max(h, w) instead of after its last temporal position) the video log-probs move.
    video_seq = seqs[2]
    grid = video_seq.grids[0]
    ids = video_seq.token_ids
    video_end = int(np.flatnonzero(ids == args.video_token_id)[-1]) + 1
    start = int(video_seq.position_ids[0, video_end - grid.num_tokens(2)])
    hf_next = start + max(grid.h, grid.w) // 2
    shifted = video_seq.position_ids.copy()
    shifted[:, video_end:] -= int(video_seq.position_ids[0, video_end]) - hf_next
    assert (shifted != video_seq.position_ids).any()
    alt = pack_sequences([type(video_seq)(ids, shifted, video_seq.grids, video_seq.pixel_values)])
    n_prompt, n_completion = spans[2]
    alt_pos = torch.arange(n_prompt - 1, n_prompt - 1 + n_completion)
    with torch.no_grad():
        alt_out = model(alt, LogprobTargets(positions=alt_pos, token_ids=alt.input_ids[alt_pos + 1]))
    ref = torch.tensor(vllm_probe_results["video"]["logprobs"])
    assert (alt_out.logprobs - ref).abs().max().item() > 10 * TOL
