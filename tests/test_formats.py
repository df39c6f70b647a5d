"""data.path readers: the same samples as a titanrl manifest, verl Parquet, EasyR1 Parquet, chat-message
JSONL (columns format, images as base64 data URIs) and a saved Hugging Face dataset prepare to identical
token ids, vision grids and pixel values; bad rows are named (file, row, key) or counted skips."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import fork_launch
from train_runs import failure_report

from titanrl.assets import _build_once
from titanrl.data.formats import BadRow, ColumnMap
from titanrl.data.manifest import read_manifest
from titanrl.data.preprocess import MediaSettings, prepare_sample
from titanrl.data.prompt import PromptEncoder, chat_messages
from titanrl.data.sources import ImportSettings, dataset_manifest, import_dataset, is_native_manifest
from titanrl.data.synth import generate_dataset
from titanrl.data.synth_formats import format_rows, write_format
from titanrl.data.tables import DatasetError


@pytest.fixture(scope="module")
def synth(tmp_path_factory) -> Path:
    return generate_dataset(tmp_path_factory.mktemp("synth"), "image-heavy", 8, seed=5)  # images and videos


@pytest.fixture(scope="module")
def setup(tiny_ckpt):
    return PromptEncoder.from_pretrained(tiny_ckpt), MediaSettings.from_checkpoint(tiny_ckpt, fps=2.0, max_frames=8)


def _chat_jsonl(synth: Path, out: Path) -> Path:
    lines = []
    for r in read_manifest(synth):
        images = [f"data:image/png;base64,{base64.b64encode((synth.parent / m.path).read_bytes()).decode()}"
                  for m in r.media if m.kind == "image"]
        videos = [str(Path(synth.parent.name) / m.path) for m in r.media if m.kind == "video"]
        lines.append(json.dumps({"id": r.id, "messages": chat_messages(r.prompt), "answer": r.answer,
                                 "pictures": images, "clips": videos}))
    out.write_text("\n".join(lines) + "\n")
    return out


def _chat_rows(synth: Path, out: Path, inline: bool) -> Path:
    """The chat format as users bring it: media inline in the message parts (Qwen2.5-VL's examples; answer under
    ``solution``) or bare parts filled from ``images`` / ``videos`` columns (TRL's layout; ``ground_truth``)."""
    lines = []
    for r in read_manifest(synth):
        messages = chat_messages(r.prompt)
        media = iter(r.media)
        row: dict = {"id": r.id, "source": r.source, "images": [], "videos": []}
        for part in messages[-1]["content"]:
            if part["type"] in ("image", "video"):
                m = next(media)
                value = (f"data:image/png;base64,{base64.b64encode((synth.parent / m.path).read_bytes()).decode()}"
                         if m.kind == "image" else str(Path(synth.parent.name) / m.path))
                if inline:
                    part[m.kind] = value
                else:
                    row[f"{m.kind}s"].append(value)
        row.update(messages=messages, **({"solution": r.answer} if inline else {"ground_truth": r.answer}))
        if inline:
            del row["images"], row["videos"]
        lines.append(json.dumps(row))
    out.write_text("\n".join(lines) + "\n")
    return out


def _hf_saved(synth: Path, out: Path) -> Path:
    datasets = pytest.importorskip("datasets")
    rows = format_rows(read_manifest(synth), synth.parent, synth.parent, "easyr1")
    for row in rows:
        row["videos"] = [str((synth.parent / v).resolve()) for v in row["videos"]]
    features = datasets.Features({
        "id": datasets.Value("string"), "problem": datasets.Value("string"), "answer": datasets.Value("string"),
        "images": datasets.List(datasets.Image()), "videos": datasets.List(datasets.Value("string")),
    })
    datasets.Dataset.from_list(rows, features=features).save_to_disk(str(out))
    return out


def _prepared(manifest: Path, setup) -> dict[str, tuple]:
    encoder, settings = setup
    out = {}
    for record in read_manifest(manifest, check_files=True):
        p = prepare_sample(record, manifest.parent, encoder, settings)
        out[record.id] = (p.prompt_ids, [(g.t, g.h, g.w, g.is_video) for g in p.grids], p.pixel_values)
    return out


def test_every_format_prepares_identically(synth, setup, tmp_path):
    root = synth.parent
    records = read_manifest(synth)
    sources = {
        "verl": (write_format(records, root, tmp_path / "verl" / "train.parquet", "verl"), ImportSettings()),
        "easyr1": (write_format(records, root, tmp_path / "easyr1" / "part.parquet", "easyr1", row_group_size=3),
                   ImportSettings()),
        "chat": (_chat_jsonl(synth, root.parent / f"{root.name}_chat.jsonl"),
                 ImportSettings(format="columns", columns=ColumnMap("messages", "answer", "pictures", "clips"))),
        "hf": (_hf_saved(synth, tmp_path / "hf"), ImportSettings()),
        # the chat format, told apart by its keys (data.format = auto)
        "chat_inline": (_chat_rows(synth, root.parent / f"{root.name}_inline.jsonl", inline=True), ImportSettings()),
        "chat_columns": (_chat_rows(synth, root.parent / f"{root.name}_columns.jsonl", inline=False),
                         ImportSettings()),
    }
    assert is_native_manifest(synth, "auto")
    expected = _prepared(synth, setup)
    assert {g[3] for v in expected.values() for g in v[1]} == {False, True}  # images and videos covered
    cache = tmp_path / "cache"
    for name, (path, settings) in sources.items():
        manifest, report = dataset_manifest(path, cache, settings, _build_once)
        assert report is not None and report.samples == len(records) and not report.skipped, name
        got = _prepared(manifest, setup)
        assert list(got) == list(expected), name
        for sid, (ids, grids, pixels) in expected.items():
            np.testing.assert_array_equal(got[sid][0], ids, err_msg=f"{name} {sid}")
            assert got[sid][1] == grids, (name, sid)
            np.testing.assert_array_equal(got[sid][2], pixels, err_msg=f"{name} {sid}")
    # a second call reuses the import (same folder, nothing rewritten)
    again, _ = dataset_manifest(sources["verl"][0], cache, ImportSettings(), _build_once)
    assert again.parent.joinpath(".complete").is_file()


def test_system_prompt_and_chat_system_message(tmp_path, setup):
    encoder, _ = setup
    (tmp_path / "d.jsonl").write_text(json.dumps({"q": "hi", "a": "1"}) + "\n" + json.dumps(
        {"q": [{"role": "system", "content": "own"}, {"role": "user", "content": "yo"}], "a": "2"}) + "\n")
    report = import_dataset(tmp_path / "d.jsonl", tmp_path / "out",
                            ImportSettings(format="columns", columns=ColumnMap("q", "a", system_prompt="be brief")))
    first, second = read_manifest(tmp_path / "out" / "manifest.jsonl")
    assert report.samples == 2 and (first.system, second.system) == ("be brief", "own")
    assert "be brief" in encoder.render(first.prompt, first.system)


def _png() -> str:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 28), (200, 10, 10)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


BAD_ROWS = {
    "missing key": ({"problem": "<image>x", "images": ["IMG"]}, r"row 1: missing key 'answer'"),
    "unreadable bytes": ({"problem": "<image>x", "answer": "1", "images": ["data:image/png;base64,bm90IGFuIGltYWdl"]},
                         r"row 1: key 'images\[0\]': image bytes \(12 B\) are not a readable image"),
    "placeholder count": ({"problem": "<image><image>x", "answer": "1", "images": ["IMG"]},
                          r"row 1: key 'problem' has 2 <image> placeholder\(s\) but key 'images' has 1 image\(s\)"),
    "non-string answer": ({"problem": "<image>x", "answer": 42, "images": ["IMG"]},
                          r"row 1: key 'answer' must be a str, got int"),
    "missing file": ({"problem": "<image>x", "answer": "1", "images": ["nope.png"]},
                     r"row 1: key 'images\[0\]' names a missing file .*nope.png"),
}
CHAT_BAD_ROWS = {
    "no answer": ({"messages": [{"role": "user", "content": [{"type": "image", "image": "IMG"},
                                                             {"type": "text", "text": "x"}]}]},
                  r"row 1: no answer: expected a key 'answer' / 'solution' / 'ground_truth' or a final assistant"),
    "bare part without column": ({"messages": [{"role": "user", "content": [{"type": "image"}]}], "answer": "1"},
                                 r"row 1: key 'messages\[0\].content' has 1 image part\(s\) without the image itself "
                                 r"\(0 inline\) but key 'images' has 0 image\(s\)"),
    "two user messages": ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                           "answer": "1"}, r"row 1: key 'messages\[1\]': role 'user' not supported here"),
    "per-image resizing": ({"messages": [{"role": "user", "content": [{"type": "image", "image": "IMG",
                                                                       "max_pixels": 50176}]}], "answer": "1"},
                           r"row 1: key 'messages\[0\].content\[0\]' sets 'max_pixels' for this image alone; titanrl "
                           r"samples and resizes every image by the run's data.fps"),
}


def _write_rows(path: Path, bad: list[dict]) -> Path:
    good = {"problem": "<image>How many?", "answer": "1", "images": ["IMG"]}
    rows = [good, *bad, good]
    path.write_text("".join(json.dumps({**r, "images": [_png() if i == "IMG" else i for i in r.get("images", [])]})
                            + "\n" for r in rows))
    return path


@pytest.mark.parametrize("kind", list(BAD_ROWS))
def test_bad_row_is_named(kind, tmp_path):
    row, message = BAD_ROWS[kind]
    path = _write_rows(tmp_path / "easy.jsonl", [row])
    with pytest.raises(BadRow, match=f"easy.jsonl: {message}"):
        import_dataset(path, tmp_path / "out", ImportSettings(on_bad_sample="error"))


@pytest.mark.parametrize("kind", list(CHAT_BAD_ROWS))
def test_bad_chat_row_is_named(kind, tmp_path):
    row, message = CHAT_BAD_ROWS[kind]
    good = {"messages": [{"role": "user", "content": [{"type": "image", "image": _png()}, {"type": "text",
                                                                                        "text": "How many?"}]}],
            "answer": "1"}
    bad = json.loads(json.dumps(row).replace('"IMG"', json.dumps(_png())))
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (good, bad, good)))
    with pytest.raises(BadRow, match=f"chat.jsonl: {message}"):
        import_dataset(tmp_path / "chat.jsonl", tmp_path / "out", ImportSettings(on_bad_sample="error"))


def test_chat_answer_from_a_final_assistant_message_and_llama_factory_placeholders(tmp_path):
    """LLaMA-Factory's layout: ``<image>`` in the user's text, the images in a column, the answer the final
    assistant message."""
    row = {"messages": [{"role": "system", "content": "be brief"},
                        {"role": "user", "content": "<image>How many?"},
                        {"role": "assistant", "content": "3"}], "images": [_png()]}
    (tmp_path / "lf.jsonl").write_text(json.dumps(row) + "\n")
    report = import_dataset(tmp_path / "lf.jsonl", tmp_path / "out", ImportSettings())
    [record] = read_manifest(tmp_path / "out" / "manifest.jsonl", check_files=True)
    assert report.samples == 1 and (record.prompt, record.answer, record.system) == ("<image>How many?", "3",
                                                                                     "be brief")
    assert [m.kind for m in record.media] == ["image"]


def _png_of(size, colour) -> str:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _pil(uri: str):
    import io

    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1]))).convert("RGB")


def test_a_conversation_before_the_prompt_is_kept_and_rendered_whole(tmp_path, setup, tiny_ckpt):
    """A prompt with earlier turns (few-shot examples, a conversation): verl's prompt list, the chat format with the
    images inline, and a titanrl manifest with ``history`` import to the same record (the earlier user and
    assistant messages, the last user message as the prompt, the images in the order the conversation shows them),
    and it prepares to what transformers' processor gives for the whole conversation's chat template. Turns out of
    order are named."""
    from transformers import AutoProcessor

    first, second = _png_of((32, 28), (200, 10, 10)), _png_of((56, 28), (10, 200, 10))
    turns = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "<image>What colour?"},
             {"role": "assistant", "content": "red"}, {"role": "user", "content": "<image>And this one?"}]
    inline = [turns[0], {"role": "user", "content": [{"type": "image", "image": first},
                                                     {"type": "text", "text": "What colour?"}]},
              turns[2], {"role": "user", "content": [{"type": "image", "image": second},
                                                      {"type": "text", "text": "And this one?"}]},
              {"role": "assistant", "content": "green"}]
    rows = {"verl.jsonl": {"prompt": turns, "images": [first, second], "answer": "green"},
            "chat.jsonl": {"messages": inline}}
    records = {}
    for name, row in rows.items():
        (tmp_path / name).write_text(json.dumps(row) + "\n")
        import_dataset(tmp_path / name, tmp_path / name.replace(".", "_"),
                       ImportSettings(format="columns", columns=ColumnMap("prompt", "answer")) if name == "verl.jsonl"
                       else ImportSettings())
        [records[name]] = read_manifest(tmp_path / name.replace(".", "_") / "manifest.jsonl", check_files=True)
    # the titanrl manifest names the images the other imports wrote
    native = records["verl.jsonl"].to_json_dict()
    native["media"] = [{"path": str(tmp_path / "verl_jsonl" / m["path"]), "kind": "image"} for m in native["media"]]
    (tmp_path / "own.jsonl").write_text(json.dumps(native) + "\n")
    import_dataset(tmp_path / "own.jsonl", tmp_path / "own", ImportSettings())
    [records["own"]] = read_manifest(tmp_path / "own" / "manifest.jsonl", check_files=True)
    for name, record in records.items():
        assert record.history == [{"role": "user", "content": "<image>What colour?"},
                                  {"role": "assistant", "content": "red"}], name
        assert (record.prompt, record.system, record.answer) == ("<image>And this one?", "be brief", "green"), name
    encoder, settings = setup
    processor = AutoProcessor.from_pretrained(tiny_ckpt)
    conversation = [turns[0]] + [{"role": t["role"], "content": [{"type": "image"}, {"type": "text",
                                                                                      "text": t["content"][7:]}]}
                                 if t["role"] == "user" else {"role": "assistant",
                                                              "content": [{"type": "text", "text": t["content"]}]}
                                 for t in turns[1:]]
    text = processor.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert encoder.render(records["own"].prompt, records["own"].system, records["own"].history) == text
    for name, record in records.items():
        root = tmp_path / {"verl.jsonl": "verl_jsonl", "chat.jsonl": "chat_jsonl", "own": "own"}[name]
        prepared = prepare_sample(record, root, encoder, settings)
        ref = processor(text=[text], images=[_pil(first), _pil(second)], return_tensors="np")
        np.testing.assert_array_equal(prepared.prompt_ids, ref["input_ids"][0], err_msg=name)
        np.testing.assert_array_equal(prepared.pixel_values, ref["pixel_values"], err_msg=name)  # red, then green
    bad = {"two users": [turns[1], turns[3]], "ends with the assistant": turns[:3]}
    for why, messages in bad.items():
        (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": messages, "images": [first, second],
                                                         "answer": "1"}) + "\n")
        match = "'assistant' expected here" if why == "two users" else "ends with an assistant message"
        with pytest.raises(BadRow, match=match):
            import_dataset(tmp_path / "bad.jsonl", tmp_path / "bad", ImportSettings(
                format="columns", columns=ColumnMap("prompt", "answer"), on_bad_sample="error"))


def test_bad_rows_are_counted_skips(tmp_path):
    path = _write_rows(tmp_path / "easy.jsonl", [row for row, _ in BAD_ROWS.values()])
    report = import_dataset(path, tmp_path / "out", ImportSettings(on_bad_sample="skip"))
    assert (report.rows, report.samples) == (2 + len(BAD_ROWS), 2)
    assert [s["row"] for s in report.skipped] == list(range(1, 1 + len(BAD_ROWS)))
    assert json.loads((tmp_path / "out" / "import.json").read_text())["skipped"] == report.skipped
    [a, b] = read_manifest(tmp_path / "out" / "manifest.jsonl", check_files=True)
    assert (a.id, b.id) == ("easy-0", f"easy-{1 + len(BAD_ROWS)}")


def test_unknown_schema_names_the_keys(tmp_path):
    (tmp_path / "x.jsonl").write_text(json.dumps({"question": "q", "label": "a"}) + "\n")
    with pytest.raises(DatasetError, match=r"x.jsonl: row 0: cannot tell the dataset format.*'label', 'question'"):
        import_dataset(tmp_path / "x.jsonl", tmp_path / "out", ImportSettings())


def test_data_config_path_checks():
    from titanrl.config.job_config import DataConfig

    assert any("set only data.path" in p for p in DataConfig(path="a.parquet", manifest="b.jsonl").problems())
    assert any("data.prompt_key must not be empty" in p for p in DataConfig(format="columns", prompt_key="").problems())
    assert not DataConfig(manifest="b.jsonl").problems()


@pytest.mark.slow
def test_import_on_four_ranks_reads_own_row_groups_and_matches_one_process(synth, tmp_path):
    """4 ranks under torchrun import a verl Parquet file of 8 row groups: each rank reads only the row groups
    it was given (no whole-file read), together all of them once; the manifest, the media files and the
    header cache equal a one-process import's; a bad row stops every rank with the same named error. Then as two
    machines without a shared cache (ranks 0-1 and 2-3 each with their own model.cache_dir): each pair finds the
    other does not share it, builds its own tiny checkpoint and imports into its own cache, the same output."""
    import os
    import sys

    import pyarrow as pa
    import pyarrow.parquet as pq

    from titanrl.data.shadow.metadata import cache_path_for
    from titanrl.data.sources import ImportReport

    records = read_manifest(synth)
    data = write_format(records, synth.parent, tmp_path / "verl" / "train.parquet", "verl", row_group_size=1)
    assert pq.ParquetFile(data).num_row_groups == len(records) == 8
    # the same rows with the 7th's ground truth removed (row group 6: not rank 0's, see below)
    table = pq.read_table(data).to_pylist()
    table[6]["reward_model"] = {"style": "rule"}
    bad = tmp_path / "bad" / "train.parquet"
    bad.parent.mkdir()
    pq.write_table(pa.Table.from_pylist(table), bad, row_group_size=1)

    single = tmp_path / "single"
    import_dataset(data, single, ImportSettings())
    out = tmp_path / "out"
    out.mkdir()
    script = Path(__file__).parent / "dist" / "import_rows.py"
    proc = fork_launch.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                            str(script), "--data", str(data), "--bad", str(bad), "--cache", str(tmp_path / "cache"),
                            "--out", str(out)], {**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0, failure_report(proc)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    target = Path(ranks[0]["manifest"]).parent
    assert all(r["manifest"] == ranks[0]["manifest"] for r in ranks)

    # each rank read its own row groups, all of them exactly once between them, and nothing else
    report = ImportReport.read(target)
    assert [sorted(r["reads"]) for r in ranks] == [
        sorted(int(u.rsplit(" ", 1)[1]) for u in report.ranks[r]["units"]) for r in range(4)]
    assert sorted(g for r in ranks for g in r["reads"]) == list(range(8))
    assert all(r["reads"] for r in ranks) and sum(x["rows"] for x in report.ranks) == 8

    # the same output as one process: manifest, image files, header cache (less the files' mtimes)
    assert (target / "manifest.jsonl").read_bytes() == (single / "manifest.jsonl").read_bytes()
    files = sorted(p.name for p in (single / "media").iterdir())
    assert files and sorted(p.name for p in (target / "media").iterdir()) == files
    assert all((target / "media" / f).read_bytes() == (single / "media" / f).read_bytes() for f in files)

    def headers(folder: Path) -> list[dict]:
        lines = cache_path_for(folder / "manifest.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if k != "mtime_ns"} for x in lines[1:]]

    assert headers(target) == headers(single) and len(headers(single)) == sum(len(r.media) for r in records)

    # the bad row: every rank raises the one-process import's error, naming file, row and key
    with pytest.raises(BadRow) as expected:
        import_dataset(bad, tmp_path / "bad_single", ImportSettings(on_bad_sample="error"))
    assert "train.parquet: row 6: key 'reward_model.ground_truth'" in str(expected.value)
    assert [r["bad_error"] for r in ranks] == [str(expected.value)] * 4
    assert 6 not in ranks[0]["bad_reads"]

    # no shared cache: two groups, each prepares everything its ranks read, in its own folder
    split = [r["split"] for r in ranks]
    assert [s["ranks"] for s in split] == [[0, 1], [0, 1], [2, 3], [2, 3]] and not any(s["shared"] for s in split)
    for machine, pair in enumerate((split[:2], split[2:])):
        root = tmp_path / f"cache-split/m{machine}"
        folder = Path(pair[0]["manifest"]).parent
        assert all(s["manifest"] == pair[0]["manifest"] for s in pair) and folder.is_relative_to(root)
        assert (folder / ".complete").is_file() and (Path(pair[0]["model"]) / ".complete").is_file()
        assert Path(pair[0]["model"]).is_relative_to(root) and (Path(pair[0]["model"]) / "config.json").is_file()
        assert (folder / "manifest.jsonl").read_bytes() == (single / "manifest.jsonl").read_bytes()
        assert sorted(p.name for p in (folder / "media").iterdir()) == files
        # the pair's two ranks read the 8 row groups between them, each its own
        assert sorted(pair[0]["reads"] + pair[1]["reads"]) == list(range(8)) and pair[0]["reads"] and pair[1]["reads"]
        assert not list(root.glob(".titanrl-ranks-*"))  # the probe leaves nothing behind


def _noise_png(path: Path, seed: int, size=(56, 42)) -> Path:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def test_a_video_given_as_its_frames_imports_and_prepares_as_transformers_does(tmp_path, setup, tiny_ckpt):
    """A video given as a list of frames (qwen-vl-utils' form) -- inline in a chat part as data URIs with the part's
    ``fps``, as files in a verl ``videos`` column ({'video': [...], 'fps'}), and as a frame list file a titanrl
    manifest names -- imports to a frame list and prepares to exactly what transformers' processor gives for those
    frames at that rate (ids, pixels, grid, seconds per temporal patch). An odd count is sampled to an even one like
    a video file's frames; frames of two sizes and a missing frame are named."""
    from PIL import Image
    from transformers import AutoProcessor

    from titanrl.data.media import MediaError, load_video, probe_video, write_frame_list

    files = [_noise_png(tmp_path / f"f{i}.png", i) for i in range(6)]
    uris = ["data:image/png;base64," + base64.b64encode(f.read_bytes()).decode() for f in files]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": [
        {"type": "video", "video": uris, "fps": 1.0}, {"type": "text", "text": "What moves?"}]}],
        "answer": "noise"}) + "\n")
    (tmp_path / "verl.jsonl").write_text(json.dumps({"prompt": "<video>What moves?", "answer": "noise",
                                                     "videos": [{"video": [f.name for f in files], "fps": 1}]}) + "\n")
    frame_list = write_frame_list(tmp_path / "clip.frames.json", [f.name for f in files], 1.0)
    (tmp_path / "own.jsonl").write_text(json.dumps({"id": "own", "source": "s", "prompt": "<video>What moves?",
                                                    "media": [{"path": frame_list.name, "kind": "video"}],
                                                    "answer": "noise", "answer_choices": []}) + "\n")
    roots = {}
    for name in ("chat.jsonl", "verl.jsonl"):
        import_dataset(tmp_path / name, tmp_path / name.replace(".", "_"),
                       ImportSettings(format="columns", columns=ColumnMap("prompt", "answer")) if name == "verl.jsonl"
                       else ImportSettings())
        roots[name] = tmp_path / name.replace(".", "_") / "manifest.jsonl"
    roots["own"] = tmp_path / "own.jsonl"
    assert is_native_manifest(roots["own"], "auto")

    encoder, settings = setup
    processor = AutoProcessor.from_pretrained(tiny_ckpt)
    frames = np.stack([np.asarray(Image.open(f).convert("RGB")) for f in files])
    for name, manifest in roots.items():
        [record] = read_manifest(manifest, check_files=True)
        assert [m.kind for m in record.media] == ["video"] and record.media[0].path.endswith(".frames.json"), name
        prepared = prepare_sample(record, manifest.parent, encoder, settings)
        text = encoder.render(record.prompt)
        ref = processor(text=[text], videos=[frames], do_sample_frames=False, return_tensors="np",
                        video_metadata=[{"fps": 1.0, "total_num_frames": 6, "frames_indices": list(range(6))}])
        np.testing.assert_array_equal(prepared.prompt_ids, ref["input_ids"][0], err_msg=name)
        np.testing.assert_array_equal(prepared.pixel_values, ref["pixel_values_videos"], err_msg=name)
        [grid] = prepared.grids
        assert [[grid.t, grid.h, grid.w]] == ref["video_grid_thw"].tolist(), name
        assert grid.second_per_grid == pytest.approx(float(ref["second_per_grid_ts"][0])) == 2.0, name

    # an odd count: sampled to an even one like a video file's (uniform in time); fps 2.0 when none is named
    odd = write_frame_list(tmp_path / "odd.frames.json", [str(f) for f in files[:5]])
    got, info = load_video(odd, fps=2.0)
    assert (info.num_frames, info.fps, info.codec, info.sampled_indices) == (5, 2.0, "frames", (0, 1, 3, 4))
    np.testing.assert_array_equal(got, frames[[0, 1, 3, 4]])
    part, info = load_video(odd, fps=2.0, frame_range=(1, 3))  # what slice-aware loading fetches
    np.testing.assert_array_equal(part, frames[[1, 3]])
    assert info.decoded_frames == 2
    # frames of two sizes, a missing frame: the frame list and the frame are named
    _noise_png(tmp_path / "big.png", 9, size=(64, 42))
    mixed = write_frame_list(tmp_path / "mixed.frames.json", ["f0.png", "f1.png", "big.png"])
    with pytest.raises(MediaError, match=r"mixed.frames.json: frame 2 \(.*big.png\) is 64x42, frame 0 56x42"):
        probe_video(mixed)
    gone = write_frame_list(tmp_path / "gone.frames.json", ["f0.png", "nope.png"])
    with pytest.raises(MediaError, match=r"gone.frames.json: frame 1 \(.*nope.png\): file does not exist"):
        probe_video(gone)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": [
        {"type": "video", "video": [uris[0], "missing.png"]}, {"type": "text", "text": "x"}]}], "answer": "1"}) + "\n")
    with pytest.raises(BadRow, match=r"row 0: key 'messages\[0\].content\[0\]\[1\]' names a missing file"):
        import_dataset(tmp_path / "bad.jsonl", tmp_path / "bad", ImportSettings(on_bad_sample="error"))
    # qwen-vl-utils' per-video sampling keys are refused by name (a frame list's fps, the frames' rate, is kept)
    (tmp_path / "opts.jsonl").write_text(json.dumps({"problem": "<video>x", "answer": "1",
                                                     "videos": [{"video": "f0.png", "fps": 1.0, "max_frames": 8}]}))
    with pytest.raises(BadRow, match=r"row 0: key 'videos\[0\]' sets 'fps', 'max_frames' for this video alone"):
        import_dataset(tmp_path / "opts.jsonl", tmp_path / "opts", ImportSettings(on_bad_sample="error"))
    # the header cache knows a frame list by its frames too: a frame replaced is probed again
    from titanrl.data.shadow.metadata import HeaderCache, probe_media_file

    cache = HeaderCache(None)
    header, error, _ = probe_media_file(tmp_path, frame_list.name, "video", cache)
    assert error is None and (header.num_frames, header.fps, cache.probes) == (6, 1.0, 1)
    assert probe_media_file(tmp_path, frame_list.name, "video", cache)[0] == header and cache.probes == 1
    _noise_png(tmp_path / "f5.png", 5, size=(64, 42))
    header, error, _ = probe_media_file(tmp_path, frame_list.name, "video", cache)
    assert header is None and "frame 5" in str(error) and cache.probes == 2


def test_a_video_given_as_its_bytes_is_imported_to_a_file(tmp_path, setup):
    """A video's bytes (HF's Video feature {'bytes', 'path'} in Parquet, a data URI in JSONL) are written to a file
    of the container's suffix and prepare as the file itself does; bytes that are no video are named."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    synth = generate_dataset(tmp_path / "synth", "only-video", 2, seed=2)
    record = read_manifest(synth)[0]
    data = (synth.parent / record.media[0].path).read_bytes()
    video = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    pq.write_table(pa.table({"problem": [record.prompt], "answer": [record.answer],
                             "videos": pa.array([[{"bytes": data, "path": None}]], pa.list_(video))}),
                   tmp_path / "v.parquet")
    uri = "data:video/mp4;base64," + base64.b64encode(data).decode()
    (tmp_path / "v.jsonl").write_text(json.dumps({"problem": record.prompt, "answer": record.answer,
                                                  "videos": [uri]}) + "\n")
    encoder, settings = setup
    want = prepare_sample(record, synth.parent, encoder, settings)
    for name in ("v.parquet", "v.jsonl"):
        import_dataset(tmp_path / name, tmp_path / name.replace(".", "_"), ImportSettings())
        [got] = read_manifest(tmp_path / name.replace(".", "_") / "manifest.jsonl", check_files=True)
        assert got.media[0].path.endswith(".mp4"), name
        prepared = prepare_sample(got, tmp_path / name.replace(".", "_"), encoder, settings)
        np.testing.assert_array_equal(prepared.pixel_values, want.pixel_values, err_msg=name)
        np.testing.assert_array_equal(prepared.prompt_ids, want.prompt_ids, err_msg=name)
    nope = "data:video/mp4;base64," + base64.b64encode(b"nope").decode()
    bad = {"problem": "<video>x", "answer": "1", "videos": [nope]}
    (tmp_path / "bad.jsonl").write_text(json.dumps(bad) + "\n")
    with pytest.raises(BadRow, match=r"row 0: key 'videos\[0\]': video bytes \(4 B\) are not a readable video"):
        import_dataset(tmp_path / "bad.jsonl", tmp_path / "bad", ImportSettings(on_bad_sample="error"))
