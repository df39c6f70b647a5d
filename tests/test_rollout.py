"""Rollout engines (titanrl.rollout): vLLM in-process (one engine for the whole module) and the
transformers-generate baseline, on the tiny checkpoint and synthetic text/image/video prompts.

The central check: after ``load_weights`` (no restart), vLLM's log-probs of its sampled tokens
equal what titanrl's own model computes with the new weights, including for an image the engine
saw before the update (its encoder and prefix caches must have been reset)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from titanrl.data.manifest import read_manifest
from titanrl.data.preprocess import MediaSettings, prepare_sample
from titanrl.data.prompt import PromptEncoder
from titanrl.rollout import (
    PromptMismatchError,
    RolloutRequest,
    WeightsMismatchError,
    mm_limits_for,
    probe_logprobs,
    request_seed,
)
from titanrl.rollout.types import check_prompt_ids
from titanrl.rollout.weights import (
    QWEN2_5_VL_PACKED_MODULES,
    check_update,
    engine_module,
    read_header,
    read_headers,
)

TOL = 1e-4
FPS, MAX_FRAMES = 4.0, 8  # the synthetic clip's sampled fps is then not 2: second_per_grid != 1
PERTURBED = {  # titanrl name -> HF name
    "output.weight": "lm_head.weight",
    "layers.0.attention.wv.weight": "model.layers.0.self_attn.v_proj.weight",
    "vision.merger.fc2.weight": "visual.merger.mlp.2.weight",
}
SAMPLING = dict(n=3, temperature=1.0, top_p=1.0, max_new_tokens=8)


# ----------------------------------------------------------------------------------------------
# Data: a text, an image and a video request from the synthetic generator via prepare_sample
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    from titanrl.data.synth import generate_dataset

    return generate_dataset(tmp_path_factory.mktemp("rollout_data"), "image-heavy", 3, seed=0)


@pytest.fixture(scope="module")
def encoder(tiny_ckpt) -> PromptEncoder:
    return PromptEncoder.from_pretrained(tiny_ckpt)


def make_requests(tiny_ckpt, dataset, encoder, settings=None) -> dict[str, RolloutRequest]:
    settings = settings or MediaSettings.from_checkpoint(tiny_ckpt, fps=FPS, max_frames=MAX_FRAMES)
    records = read_manifest(dataset)
    out = {}
    for record in records:
        kind = record.media[0].kind
        if kind not in out:
            out[kind] = RolloutRequest.from_prepared(prepare_sample(record, dataset.parent, encoder, settings), encoder)
    # Long enough (> vLLM's KV block size) that prefix caching really caches its blocks.
    question = records[0].prompt.replace("<image>", "").replace("<video>", "").strip()
    text_prompt = " ".join([question] * 12)
    out["text"] = RolloutRequest(encoder.render(text_prompt), encoder.encode(text_prompt, []))
    assert set(out) == {"text", "image", "video"}
    assert out["video"].grids[0].second_per_grid != 1.0
    return {k: out[k] for k in ("text", "image", "video")}


@pytest.fixture(scope="module")
def requests_(tiny_ckpt, dataset, encoder) -> dict[str, RolloutRequest]:
    return make_requests(tiny_ckpt, dataset, encoder)


# ----------------------------------------------------------------------------------------------
# titanrl's model as the reference scorer (as in test_vllm_parity)
# ----------------------------------------------------------------------------------------------

def titanrl_model(ckpt: Path):
    from titanrl.models.qwen2_5_vl import Qwen2_5_VLArgs, Qwen2_5_VLModel, load_hf_weights

    args = Qwen2_5_VLArgs.from_pretrained(ckpt)
    model = Qwen2_5_VLModel(args)
    load_hf_weights(model, ckpt)
    return model.eval()


def sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float, top_p: float,
                     banned: tuple[int, ...]) -> torch.Tensor:
    """By hand: the log-prob of each token under the distribution an engine samples from: the vision pad tokens
    banned (the engines' logit bias), the logits divided by the temperature, then truncated to the smallest set of
    most likely tokens whose probability reaches top_p (at least one kept), renormalised."""
    z = logits.double().clone()
    z[:, list(banned)] -= 100.0  # vLLM's logit bias; the hf engine suppresses them outright (e^-100: the same)
    z = z / temperature
    probs = torch.softmax(z, dim=-1)
    order = probs.argsort(dim=-1, descending=True)
    before = probs.gather(-1, order).cumsum(-1) - probs.gather(-1, order)  # mass of the more likely tokens
    drop = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, before >= top_p)
    z = z.masked_fill(drop, float("-inf"))
    return torch.log_softmax(z, dim=-1).gather(-1, tokens[:, None])[:, 0].float()


def titanrl_logprobs(model, items: list[tuple[RolloutRequest, list[int]]], *,
                     sampled: dict | None = None) -> list[torch.Tensor]:
    """titanrl's log-probs of the completions: the model's (``sampled=None``: what the probe compares), or those of
    the distribution the engines sampled from with ``sampled = dict(temperature, top_p)`` (their behaviour
    log-probs, by hand: ``sampled_logprobs``)."""
    from titanrl.models.packed import pack_sequences
    from titanrl.models.qwen2_5_vl.inputs import make_sequence_input
    from titanrl.models.qwen2_5_vl.model import LogprobTargets

    seqs, positions, offset = [], [], 0
    for request, completion in items:
        pixels = torch.from_numpy(request.pixel_values) if request.pixel_values is not None else None
        ids = np.concatenate([request.prompt_ids, np.asarray(completion, dtype=np.int64)])
        seqs.append(make_sequence_input(model.args, ids, request.grids, pixels))
        n_prompt = len(request.prompt_ids)
        positions.append(np.arange(offset + n_prompt - 1, offset + n_prompt - 1 + len(completion)))
        offset += len(ids)
    batch = pack_sequences(seqs)
    pos = torch.from_numpy(np.concatenate(positions))
    with torch.no_grad():
        if sampled is None:
            logprobs = model(batch, LogprobTargets(positions=pos, token_ids=batch.input_ids[pos + 1])).logprobs
        else:
            logits = model.logits(model(batch).hidden[pos])
            banned = (model.args.image_token_id, model.args.video_token_id)
            logprobs = sampled_logprobs(logits, batch.input_ids[pos + 1], temperature=sampled["temperature"],
                                        top_p=sampled["top_p"], banned=banned)
    return list(torch.split(logprobs, [len(c) for _, c in items]))


def perturbed_checkpoint(ckpt: Path, outdir: Path, scale: float = 0.5) -> Path:
    """The checkpoint with lm_head, a value projection (so cached KV blocks go stale) and the
    vision merger's last layer (so cached vision embeddings go stale) perturbed, saved through
    titanrl's state-dict adapter (weights only: an update needs no config files)."""
    from titanrl.models.qwen2_5_vl import save_hf_checkpoint

    model = titanrl_model(ckpt)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name in PERTURBED:
            p = model.get_parameter(name)
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    return save_hf_checkpoint(model.state_dict(), model.args, outdir)


# ----------------------------------------------------------------------------------------------
# No engine
# ----------------------------------------------------------------------------------------------

def test_request_seed_depends_on_seed_and_request_only(requests_):
    text, image, video = requests_.values()
    assert request_seed(3, image) == request_seed(3, dataclasses.replace(image))
    assert len({request_seed(3, r) for r in (text, image, video)}) == 3
    assert request_seed(3, image) != request_seed(4, image)
    # An explicit key separates identical prompts.
    assert request_seed(3, dataclasses.replace(image, key="a")) != request_seed(3, dataclasses.replace(image, key="b"))
    assert all(0 <= request_seed(s, image) < 2**62 for s in (0, 1, 2**40))


def test_the_final_close_skips_only_the_garbage_collections():
    """``VLLMEngine.close(collect=False)`` (the trainer's, at the end of its process) runs vLLM's shutdown with
    ``gc.collect`` / ``gc.unfreeze`` doing nothing; both are restored afterwards, also after an error."""
    import gc
    import weakref

    from titanrl.rollout.vllm_engine import _without_collections

    class Node:
        pass

    def cycle():
        a, b = Node(), Node()
        a.other, b.other = b, a
        return weakref.ref(a)

    collect, unfreeze = gc.collect, gc.unfreeze
    gc.disable()  # no automatic collection in between
    try:
        with pytest.raises(RuntimeError):
            with _without_collections():
                ref = cycle()
                assert gc.collect() == 0 and ref() is not None  # not collected
                gc.unfreeze()
                raise RuntimeError("shutdown failed")
        assert (gc.collect, gc.unfreeze) == (collect, unfreeze)
        assert ref() is not None
        gc.collect()
        assert ref() is None
    finally:
        gc.enable()


def test_prompt_check_names_the_difference():
    check_prompt_ids(np.array([1, 2, 3]), [1, 2, 3], what="r", image_token_id=9, video_token_id=8)
    with pytest.raises(PromptMismatchError, match=r"lengths 4 \(engine\) vs 3 \(request\).*2 image.*1 image.*index 2"):
        check_prompt_ids(np.array([1, 9, 3]), [1, 9, 9, 3], what="r", image_token_id=9, video_token_id=8)


def test_update_check(tiny_ckpt, tmp_path):
    ref = read_headers(tiny_ckpt)
    check_update(ref, {"lm_head.weight": ref["lm_head.weight"]}, where="partial")  # partial is fine
    new_style = {"model.language_model.norm.weight": ref["model.norm.weight"]}
    check_update(ref, new_style, where="transformers>=4.52 prefixes")
    bad = {"lm_head.weight": dataclasses.replace(ref["lm_head.weight"], shape=(3, 4)), "nope.weight": ref["model.norm.weight"]}
    with pytest.raises(WeightsMismatchError, match=r"1 unknown tensor.*nope\.weight.*1 shape mismatch.*lm_head\.weight: \[3, 4\]"):
        check_update(ref, bad, where="x")
    # Partial updates must cover whole engine modules (fused q/k/v, weight with bias).
    packed = QWEN2_5_VL_PACKED_MODULES
    qkv = {f"model.layers.1.self_attn.{p}_proj.{w}": ref[f"model.layers.1.self_attn.{p}_proj.{w}"]
           for p in "qkv" for w in ("weight", "bias")}
    check_update(ref, qkv, where="whole", packed=packed)
    with pytest.raises(WeightsMismatchError, match=r"model\.layers\.1\.self_attn\.qkv_proj \(missing \['model\.layers\.1\.self_attn\.k_proj\.bias'"):
        check_update(ref, {k: v for k, v in qkv.items() if k != "model.layers.1.self_attn.k_proj.bias"}, where="split", packed=packed)
    with pytest.raises(WeightsMismatchError, match=r"visual\.merger\.mlp\.2 \(missing \['visual\.merger\.mlp\.2\.bias'\]"):
        check_update(ref, {"visual.merger.mlp.2.weight": ref["visual.merger.mlp.2.weight"]}, where="split", packed=packed)
    truncated = tmp_path / "model.safetensors"
    data = (tiny_ckpt / "model.safetensors").read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsMismatchError, match="past the end of the file"):
        read_header(truncated)


def test_mm_limits_for(dataset):
    records = read_manifest(dataset)
    assert mm_limits_for(records) == {"image": 1, "video": 1}
    two = dataclasses.replace(records[0], media=records[0].media * 2)
    assert mm_limits_for([two])["image"] == 2


def test_hf_baseline_engine(tiny_ckpt, requests_, tmp_path):
    """The transformers-generate baseline: n samples, seeded, its log-probs equal titanrl's for text, images and
    video (the engine gives transformers the trainer's text-after-video positions; its own rule differs by ~0.1
    here), sampled and probed (<= 1e-4, float32), and it updates in place."""
    from titanrl.rollout.hf_engine import HFGenerateEngine

    engine = HFGenerateEngine(tiny_ckpt, fps=FPS, max_frames=MAX_FRAMES)
    reqs = [requests_["text"], requests_["image"], requests_["video"]]
    out = engine.generate(reqs, seed=5, **SAMPLING)
    assert [len(g) for g in out] == [3, 3, 3]
    assert out == engine.generate(reqs, seed=5, **SAMPLING)
    for g in out:
        for s in g:
            assert 1 <= len(s.token_ids) == len(s.logprobs) <= 8 and s.finish_reason in ("stop", "length")
    model = titanrl_model(tiny_ckpt)
    pairs = [(r, g[0].token_ids) for r, g in zip(reqs, out)]
    for (r, ids), g, mine, raw in zip(pairs, out, titanrl_logprobs(model, pairs, sampled=SAMPLING),
                                      titanrl_logprobs(model, pairs)):
        assert (mine - torch.tensor(g[0].logprobs)).abs().max() < TOL  # the distribution it sampled from
        assert np.allclose(probe_logprobs(engine, r, ids), raw.numpy(), atol=TOL)  # the model's own
    new = perturbed_checkpoint(tiny_ckpt, tmp_path / "new")
    engine.load_weights(new)
    ours = titanrl_logprobs(titanrl_model(new), [(reqs[1], out[1][0].token_ids)])[0]
    assert np.allclose(engine.score(reqs[1], out[1][0].token_ids), ours.numpy(), atol=TOL)
    engine.close()


def test_hf_engine_sleeps_between_calls_and_takes_a_weight_push_asleep(tiny_ckpt, requests_, tmp_path):
    """rollout.sleep with the hf engine: sleep() moves its weights to host memory (on this CPU machine they are
    there already: this checks the calls, not the memory), a weight push while asleep writes the host copy, and
    the next generate / score wake it with the pushed weights: the same samples and log-probs as an engine that
    never slept. Built without sleep, sleep() does nothing."""
    from titanrl.rollout.hf_engine import HFGenerateEngine

    reqs = [requests_["text"], requests_["image"]]
    new = perturbed_checkpoint(tiny_ckpt, tmp_path / "new")
    sleeper = HFGenerateEngine(tiny_ckpt, fps=FPS, max_frames=MAX_FRAMES, sleep=True)
    awake = HFGenerateEngine(tiny_ckpt, fps=FPS, max_frames=MAX_FRAMES)
    assert sleeper.generate(reqs, seed=3, **SAMPLING) == awake.generate(reqs, seed=3, **SAMPLING)
    sleeper.sleep()
    assert sleeper._asleep and all(p.device.type == "cpu" for p in sleeper.model.parameters())
    sleeper.load_weights(new)
    assert sleeper._asleep  # the push did not wake it
    awake.load_weights(new)
    out = sleeper.generate(reqs, seed=4, **SAMPLING)
    assert not sleeper._asleep and out == awake.generate(reqs, seed=4, **SAMPLING)
    sleeper.sleep()
    tokens = out[1][0].token_ids
    assert sleeper.score(reqs[1], tokens) == awake.score(reqs[1], tokens)
    awake.sleep()
    assert not awake._asleep
    sleeper.close()
    awake.close()


def test_hf_baseline_batches_prompts_like_one_at_a_time(tiny_ckpt, requests_):
    """batch_prompts > 1 (the fair baseline: prompts of different lengths left-padded into one
    generate call, media concatenated): greedy responses and their log-probs equal prompt-by-prompt
    generation, and the log-probs equal titanrl's for text and images."""
    from titanrl.rollout.hf_engine import HFGenerateEngine

    reqs = [requests_["image"], requests_["text"], requests_["video"], requests_["image"]]
    assert len({len(r.prompt_ids) for r in reqs}) == 3  # real padding
    greedy = dict(n=1, temperature=0.0, top_p=1.0, max_new_tokens=6, seed=0)  # greedy: one sample each
    one = HFGenerateEngine(tiny_ckpt, fps=FPS, max_frames=MAX_FRAMES).generate(reqs, **greedy)
    batched = HFGenerateEngine(tiny_ckpt, fps=FPS, max_frames=MAX_FRAMES, batch_prompts=3).generate(reqs, **greedy)
    assert [len(g) for g in batched] == [1, 1, 1, 1]
    for g1, gb in zip(one, batched):
        for a, b in zip(g1, gb):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            assert np.allclose(a.logprobs, b.logprobs, atol=TOL)
    # sampled, n per prompt: every sample's log-probs are those of its own prompt (rows map back right)
    engine = HFGenerateEngine(tiny_ckpt, fps=FPS, max_frames=MAX_FRAMES, batch_prompts=4)
    sampled = engine.generate(reqs, seed=1, **SAMPLING)
    assert [len(g) for g in sampled] == [3, 3, 3, 3]
    model = titanrl_model(tiny_ckpt)
    pairs = [(reqs[i], s.token_ids) for i in (0, 1, 3) for s in sampled[i]] + [(reqs[0], batched[0][0].token_ids)]
    theirs = [s.logprobs for i in (0, 1, 3) for s in sampled[i]] + [batched[0][0].logprobs]
    for ours, lp in zip(titanrl_logprobs(model, pairs, sampled=SAMPLING), theirs):
        assert (ours - torch.tensor(lp)).abs().max() < TOL


# ----------------------------------------------------------------------------------------------
# vLLM: one engine for the module
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vllm_engine(tiny_ckpt):
    import os

    from titanrl.rollout.vllm_engine import VLLM_ENV, VLLMEngine

    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_") and k not in VLLM_ENV}
    set_num_threads, threads, rng = torch.set_num_threads, torch.get_num_threads(), torch.get_rng_state()
    engine = VLLMEngine(tiny_ckpt, dtype="float32", max_model_len=1024, kv_cache_bytes=64 << 20, seed=0)
    # Starting vLLM in this process left it as it was (vLLM reseeds, patches set_num_threads,
    # rewrites LOCAL_WORLD_SIZE / LD_PRELOAD / TORCHINDUCTOR_* while it starts).
    assert {k: v for k, v in os.environ.items() if not k.startswith("VLLM_") and k not in VLLM_ENV} == env
    assert torch.set_num_threads is set_num_threads and torch.get_num_threads() == threads
    assert torch.equal(torch.get_rng_state(), rng)
    yield engine
    engine.close()


@pytest.mark.slow
def test_vllm_generates_reproducibly(vllm_engine, requests_):
    reqs = list(requests_.values())
    rng = torch.get_rng_state()
    out = vllm_engine.generate(reqs, seed=11, **SAMPLING)
    assert torch.equal(torch.get_rng_state(), rng)  # vLLM's sampler draws from it; restored
    assert [len(g) for g in out] == [3, 3, 3]
    for g in out:
        for s in g:
            assert 1 <= len(s.token_ids) == len(s.logprobs) <= 8
            assert s.finish_reason == ("length" if len(s.token_ids) == 8 else "stop")
            assert all(lp <= 0 for lp in s.logprobs)
            assert not {vllm_engine.image_token_id, vllm_engine.video_token_id} & set(s.token_ids)
        assert len({tuple(s.token_ids) for s in g}) == 3  # the n samples differ
    # Same seed: the same samples; alone or in another batch order: the same tokens.
    assert [[s.token_ids for s in g] for g in vllm_engine.generate(reqs, seed=11, **SAMPLING)] == \
        [[s.token_ids for s in g] for g in out]
    alone = vllm_engine.generate([reqs[2]], seed=11, **SAMPLING)[0]
    assert [s.token_ids for s in alone] == [s.token_ids for s in out[2]]
    assert [s.token_ids for s in vllm_engine.generate(reqs, seed=12, **SAMPLING)[0]] != [s.token_ids for s in out[0]]


@pytest.mark.slow
def test_vllm_rejects_prompt_mismatch(vllm_engine, tiny_ckpt, dataset, encoder, requests_):
    # The trainer preprocessed with other pixel limits than the engine: other grid, other ids.
    small = MediaSettings.from_checkpoint(tiny_ckpt, fps=FPS, max_frames=MAX_FRAMES, max_pixels=56 * 56)
    image = make_requests(tiny_ckpt, dataset, encoder, small)["image"]
    assert len(image.prompt_ids) < len(requests_["image"].prompt_ids)
    with pytest.raises(PromptMismatchError, match=r"request 1: .*12 image / 0 video pad tokens vs 3 image.*first difference at index 19"):
        vllm_engine.generate([requests_["text"], image], seed=0, **SAMPLING)
    dropped = dataclasses.replace(requests_["text"], prompt_ids=requests_["text"].prompt_ids[:-1])
    with pytest.raises(PromptMismatchError, match="request 0"):
        vllm_engine.generate([dropped], seed=0, **SAMPLING)


@pytest.mark.slow
def test_vllm_weight_update_matches_titanrl(vllm_engine, tiny_ckpt, requests_, tmp_path):
    reqs = list(requests_.values())
    before = vllm_engine.generate(reqs, seed=21, **SAMPLING)  # the engine sees the image first
    new = perturbed_checkpoint(tiny_ckpt, tmp_path / "update")
    model = titanrl_model(new)
    engine_id = id(vllm_engine.llm)
    seconds = vllm_engine.load_weights(new)
    assert 0 < seconds < 30 and id(vllm_engine.llm) == engine_id  # in place, no restart

    after = vllm_engine.generate(reqs, seed=21, **SAMPLING)
    items = [(r, s.token_ids) for r, g in zip(reqs, after) for s in g]
    ours = titanrl_logprobs(model, items, sampled=SAMPLING)
    theirs = [torch.tensor(s.logprobs) for g in after for s in g]
    err = max((a - b).abs().max().item() for a, b in zip(ours, theirs))
    print(f"update: load {seconds:.3f} s, max |titanrl - vLLM| {err:.2e} over {len(items)} samples")
    assert err < TOL
    # The probe (prompt log-probs of given tokens) on the tokens sampled before the update: they
    # moved, to exactly titanrl's values, for text, image and video.
    old = [(r, g[0].token_ids) for r, g in zip(reqs, before)]
    for (request, tokens), group, mine in zip(old, before, titanrl_logprobs(model, old)):
        probe = torch.tensor(probe_logprobs(vllm_engine, request, tokens))
        assert (probe - torch.tensor(group[0].logprobs)).abs().max() > 100 * TOL
        assert (probe - mine).abs().max() < TOL

    # Back to the original weights (a partial update: only the changed tensors).
    partial = tmp_path / "partial"
    partial.mkdir()
    from safetensors.torch import load_file, save_file

    original = load_file(str(tiny_ckpt / "model.safetensors"))
    modules = {engine_module(k, QWEN2_5_VL_PACKED_MODULES) for k in PERTURBED.values()}
    restore = {k: v for k, v in original.items() if engine_module(k, QWEN2_5_VL_PACKED_MODULES) in modules}
    assert len(restore) == 1 + 6 + 2  # lm_head; q/k/v weights and biases; merger fc2 weight, bias
    save_file(restore, str(partial / "model.safetensors"))
    vllm_engine.load_weights(partial)
    again = vllm_engine.generate(reqs, seed=21, **SAMPLING)
    assert [[s.token_ids for s in g] for g in again] == [[s.token_ids for s in g] for g in before]
    assert max(abs(a - b) for g, h in zip(again, before) for s, t in zip(g, h) for a, b in zip(s.logprobs, t.logprobs)) < TOL


@pytest.mark.slow
def test_behaviour_logprobs_are_those_of_the_tempered_truncated_distribution(vllm_engine, tiny_ckpt, requests_):
    """Off-policy importance weights divide by the engine's log-probs: they must be of the distribution the tokens
    were drawn from. At temperature 0.7 and top_p 0.9 both engines report exactly the hand computation (ban, divide
    by the temperature, truncate to the nucleus, renormalise; <= 1e-4 in float32), which differs from the model's
    untempered log-probs by far more."""
    from titanrl.rollout.hf_engine import HFGenerateEngine

    sampling = dict(n=3, temperature=0.7, top_p=0.9, max_new_tokens=8)
    reqs = [requests_["text"], requests_["image"]]
    model = titanrl_model(tiny_ckpt)
    for engine in (vllm_engine, HFGenerateEngine(tiny_ckpt, fps=FPS, max_frames=MAX_FRAMES)):
        out = engine.generate(reqs, seed=41, **sampling)
        pairs = [(r, s.token_ids) for r, g in zip(reqs, out) for s in g]
        reported = [torch.tensor(s.logprobs) for g in out for s in g]
        hand = titanrl_logprobs(model, pairs, sampled=sampling)
        untempered = titanrl_logprobs(model, pairs)
        err = max((a - b).abs().max().item() for a, b in zip(hand, reported))
        gap = max((a - b).abs().max().item() for a, b in zip(untempered, reported))
        print(f"{type(engine).__name__}: |hand - engine| {err:.2e}, |untempered - engine| {gap:.2e}")
        assert err < TOL and gap > 0.1


@pytest.mark.slow
def test_vllm_takes_weights_from_memory_and_checks_them_first(vllm_engine, tiny_ckpt, requests_, tmp_path):
    """update_weights (the trainer's push: tensors by reference, no file) equals load_weights of the same weights;
    a declared layout that does not fit is refused before anything loads; a stream that breaks its declaration
    stops with the tensor named."""
    from safetensors.torch import load_file

    from titanrl.rollout.weights import tensors_layout

    reqs = list(requests_.values())
    new = perturbed_checkpoint(tiny_ckpt, tmp_path / "new")
    vllm_engine.load_weights(new)
    from_files = vllm_engine.generate(reqs, seed=51, **SAMPLING)
    vllm_engine.load_weights(tiny_ckpt)
    tensors = load_file(str(new / "model.safetensors"))
    vllm_engine.update_weights(tensors_layout(tensors.items()), iter(tensors.items()))
    assert vllm_engine.generate(reqs, seed=51, **SAMPLING) == from_files
    wrong = dict(tensors_layout(tensors.items()))
    wrong["lm_head.weight"] = dataclasses.replace(wrong["lm_head.weight"], shape=(1, 1))
    with pytest.raises(WeightsMismatchError, match="shape mismatch.*lm_head"):
        vllm_engine.update_weights(wrong, iter(tensors.items()))
    assert vllm_engine.generate(reqs, seed=51, **SAMPLING) == from_files  # nothing loaded
    from titanrl.rollout.weights import checked_stream

    layout = tensors_layout(tensors.items())
    with pytest.raises(WeightsMismatchError, match="ended without 1 declared tensor"):
        list(checked_stream(iter(list(tensors.items())[:-1]), layout))
    vllm_engine.load_weights(tiny_ckpt)


def every_tensor_perturbed(ckpt: Path, scale: float = 0.2):
    """titanrl's model of ``ckpt`` with every floating tensor moved by ``scale`` of its typical magnitude, and its
    HF state dict (what the trainer's push sends)."""
    from titanrl.models.qwen2_5_vl.state_dict_adapter import Qwen2_5_VLStateDictAdapter

    model = titanrl_model(ckpt)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.abs().mean().clamp_min(0.02))  # zero biases too
    return model, Qwen2_5_VLStateDictAdapter(model.args).to_hf(dict(model.state_dict()))


def engine_parameters(engine) -> dict[str, torch.Tensor]:
    """A copy of every parameter of the engine's model, by vLLM's names (fused modules whole)."""
    return engine.llm.apply_model(lambda m: {n: p.detach().clone() for n, p in m.named_parameters()})[0]


@pytest.mark.slow
def test_a_push_loads_every_tensor_in_place(vllm_engine, tiny_ckpt, requests_):
    """The CPU engine kept its linear weights (titanrl's vLLM plugin), so a push is the model's own load_weights into
    its parameters: every parameter of the engine's model (fused q/k/v and gate/up, the vision tower's patch
    embedding, norms, merger, embeddings) takes the pushed values in place, and the engine's log-probs are titanrl's
    for text, image and video."""
    from titanrl.rollout.weights import tensors_layout

    assert vllm_engine.in_place
    reqs = list(requests_.values())
    before = engine_parameters(vllm_engine)
    storage = vllm_engine.llm.apply_model(lambda m: {n: p.data_ptr() for n, p in m.named_parameters()})[0]
    model, tensors = every_tensor_perturbed(tiny_ckpt)
    vllm_engine.update_weights(tensors_layout(tensors.items()), iter(tensors.items()))
    after = engine_parameters(vllm_engine)
    assert set(after) == set(before)
    assert [n for n in after if torch.equal(after[n], before[n])] == []  # each one loaded (none started equal)
    assert vllm_engine.llm.apply_model(lambda m: {n: p.data_ptr() for n, p in m.named_parameters()})[0] == storage
    out = vllm_engine.generate(reqs, seed=23, **SAMPLING)
    items = [(r, s.token_ids) for r, g in zip(reqs, out) for s in g]
    ours = titanrl_logprobs(model, items, sampled=SAMPLING)
    theirs = [torch.tensor(s.logprobs) for g in out for s in g]
    assert max((a - b).abs().max().item() for a, b in zip(ours, theirs)) < TOL
    vllm_engine.load_weights(tiny_ckpt)
    assert all(torch.equal(v, before[n]) for n, v in engine_parameters(vllm_engine).items())


@pytest.mark.slow
def test_the_memory_planner_counts_the_weights_the_cpu_engine_keeps(vllm_engine, tiny_ckpt):
    """What the CPU engine keeps beside its packed kernels (its linear layers' weights) is what titanrl.memory adds to
    a CPU engine's weights (``param_counts(...).linear_weights``)."""
    from vllm.model_executor.layers.linear import LinearBase

    from titanrl import memory
    from titanrl.models.qwen2_5_vl import Qwen2_5_VLArgs

    kept = vllm_engine.llm.apply_model(lambda m: sum(
        x.weight.numel() for x in m.modules() if isinstance(x, LinearBase) and hasattr(x, "cpu_linear")))[0]
    assert kept == memory.param_counts(Qwen2_5_VLArgs.from_pretrained(tiny_ckpt)).linear_weights > 0


@pytest.mark.slow
def test_vllm_rejects_bad_weights_and_keeps_working(vllm_engine, tiny_ckpt, requests_, tmp_path):
    from safetensors.torch import load_file, save_file

    reqs = list(requests_.values())
    before = vllm_engine.generate(reqs, seed=31, **SAMPLING)
    original = load_file(str(tiny_ckpt / "model.safetensors"))
    cases = {
        "wrong_shape": ({"lm_head.weight": original["lm_head.weight"][:, :-1].contiguous()}, r"shape mismatch.*lm_head\.weight"),
        "unknown_name": ({"model.layers.7.mlp.up_proj.weight": original["model.layers.0.mlp.up_proj.weight"]}, "unknown tensor"),
        "not_float": ({"lm_head.weight": original["lm_head.weight"].to(torch.int32)}, "non-floating"),
        # v_proj alone would leave q/k of the fused qkv_proj uninitialised after the reload.
        "split_module": ({"model.layers.0.self_attn.v_proj.weight": original["model.layers.0.self_attn.v_proj.weight"]},
                         r"given only in part.*qkv_proj"),
    }
    for name, (tensors, message) in cases.items():
        d = tmp_path / name
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"))
        with pytest.raises(WeightsMismatchError, match=message):
            vllm_engine.load_weights(d)
    truncated = tmp_path / "truncated"
    shutil.copytree(tiny_ckpt, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(WeightsMismatchError, match="truncated"):
        vllm_engine.load_weights(truncated)
    with pytest.raises(WeightsMismatchError, match="no \\*.safetensors"):
        vllm_engine.load_weights(tmp_path)
    after = vllm_engine.generate(reqs, seed=31, **SAMPLING)
    assert [[s.token_ids for s in g] for g in after] == [[s.token_ids for s in g] for g in before]


@pytest.mark.slow
def test_a_response_continued_from_its_prefix_equals_the_whole_generation(vllm_engine, tiny_ckpt, requests_):
    """Partial rollouts (rollout.tokens_per_update): an engine given the response so far as a prefix continues it;
    greedy, 3 tokens then the rest from that prefix give the tokens and log-probs of 8 tokens at once (vLLM and
    the HF engine; image, text and video prompts; the prefix's ids are checked against the trainer's)."""
    from titanrl.rollout.hf_engine import HFGenerateEngine

    reqs = list(requests_.values())
    greedy = dict(n=1, temperature=0.0, top_p=1.0, seed=0)
    for engine in (vllm_engine, HFGenerateEngine(tiny_ckpt, fps=FPS, max_frames=MAX_FRAMES)):
        whole = [g[0] for g in engine.generate(reqs, max_new_tokens=8, **greedy)]
        head = [g[0] for g in engine.generate(reqs, max_new_tokens=3, **greedy)]
        continued = 0
        for req, w, h in zip(reqs, whole, head):
            assert h.token_ids == w.token_ids[:3]
            if h.finish_reason == "stop":
                continue
            (tail,) = engine.generate([dataclasses.replace(req, response_prefix=tuple(h.token_ids))],
                                      max_new_tokens=5, **greedy)[0]
            assert h.token_ids + tail.token_ids == w.token_ids and tail.finish_reason == w.finish_reason
            assert np.allclose(h.logprobs + tail.logprobs, w.logprobs, atol=TOL)
            continued += 1
        assert continued >= 2, type(engine).__name__


@pytest.mark.slow
def test_one_call_with_a_token_limit_per_request_equals_a_call_per_limit(vllm_engine, tiny_ckpt, requests_):
    """Partial rollouts continue responses by what each has left in one engine call (so every rank of an engine over
    several ranks makes the same calls): sampled with per-request limits, the same tokens and log-probs as one call
    per limit (vLLM and the HF engine)."""
    from titanrl.rollout.hf_engine import HFGenerateEngine

    reqs = list(requests_.values())
    limits = [2, 5, 3, 5, 1, 4][:len(reqs)]
    sampled = dict(n=2, temperature=1.0, top_p=1.0, seed=7)
    for engine in (vllm_engine, HFGenerateEngine(tiny_ckpt, fps=FPS, max_frames=MAX_FRAMES)):
        together = engine.generate(reqs, max_new_tokens=limits, **sampled)
        for limit in set(limits):
            which = [i for i, m in enumerate(limits) if m == limit]
            alone = engine.generate([reqs[i] for i in which], max_new_tokens=limit, **sampled)
            for i, group in zip(which, alone):
                assert [s.token_ids for s in together[i]] == [s.token_ids for s in group], (type(engine), i)
                assert all(len(s.token_ids) <= limit for s in group)
                assert np.allclose([x for s in together[i] for x in s.logprobs],
                                   [x for s in group for x in s.logprobs], atol=TOL)
        with pytest.raises(ValueError, match="gives 1 limits for"):
            engine.generate(reqs, max_new_tokens=[3], **sampled)


@pytest.mark.slow
def test_vllm_engine_with_sleep_asks_vllm_for_its_sleep_mode(tiny_ckpt):
    """rollout.sleep reaches vLLM as enable_sleep_mode (what its sleep() / wake_up() need): vLLM's CPU build has
    no sleep mode and refuses it by name, before anything is loaded (the trainer never asks for it on a CPU:
    JobConfig.engine_sleeps)."""
    from titanrl.rollout.vllm_engine import VLLMEngine

    with pytest.raises(ValueError, match="Sleep mode is not supported on current platform"):
        VLLMEngine(tiny_ckpt, sleep=True)
