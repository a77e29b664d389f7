"""`mmspec train-drafter` on a tiny LLaVA pipeline (CPU, a few steps): the distillation loss of
each drafter kind decreases on a fixed batch; training regenerates the target's answers once,
checkpoints and resumes to exactly the weights of an uninterrupted run, and saves a drafter the
pipeline loads and decodes losslessly with."""

from __future__ import annotations

import pytest
import torch

from mmspec.pipelines import SpeculativeVLMPipeline
from mmspec.pipelines.train_drafter import (TrainDrafterConfig, collate, new_drafter, regenerate, step_loss,
                                            train_drafter)

from _vlm_helpers import random_images, tiny_llava_parts


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model, processor = tiny_llava_parts(dtype=torch.float32)
    pipe = SpeculativeVLMPipeline(model, processor)
    folder = tmp_path_factory.mktemp("images")
    for i, im in enumerate(random_images(4, seed=11)):
        im.save(folder / f"{i}.png")
    return pipe, folder


@pytest.mark.parametrize("kind", ["text", "eagle", "vispec"])
def test_loss_decreases_on_a_fixed_batch(setup, kind, tmp_path):
    pipe, folder = setup
    config = TrainDrafterConfig(pipeline="-", drafter=kind, out=str(tmp_path), data=str(folder), answer_tokens=8,
                                batch_size=4, lr=3e-3, progress=False)
    from mmspec.pipelines.train_drafter import data_items

    examples = regenerate(pipe, data_items(config), config)
    assert all(len(e["ids"]) > e["prompt_len"] for e in examples)  # the target's answers were appended
    batch = collate(examples, 0)
    torch.manual_seed(0)
    drafter = new_drafter(pipe, config)
    if kind == "text":  # start away from the target (the copy of its head is already close)
        with torch.no_grad():
            drafter.get_output_embeddings().weight.normal_(0, 0.5)
    optim = torch.optim.AdamW(drafter.parameters(), lr=config.lr)
    first = float(step_loss(pipe, drafter, batch, config)[0].detach())
    for _ in range(12):
        optim.zero_grad()
        step_loss(pipe, drafter, batch, config)[0].backward()
        optim.step()
    last = float(step_loss(pipe, drafter, batch, config)[0].detach())
    assert last < 0.7 * first, (first, last)


def test_train_checkpoint_resume_and_load(setup, tmp_path):
    pipe, folder = setup
    common = dict(pipeline="-", drafter="eagle", data=str(folder), answer_tokens=6, batch_size=2, lr=1e-3,
                  ttt_steps=1, save_every=2, progress=False)
    straight = train_drafter(TrainDrafterConfig(out=str(tmp_path / "a"), steps=4, **common), pipe=pipe)
    train_drafter(TrainDrafterConfig(out=str(tmp_path / "b"), steps=2, **common), pipe=pipe)
    resumed = train_drafter(TrainDrafterConfig(out=str(tmp_path / "b"), steps=4, **common), pipe=pipe)
    assert len(straight["losses"]) == 4 and len(resumed["losses"]) == 2
    assert resumed["losses"] == straight["losses"][2:]
    a = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    log = (tmp_path / "b" / "train_log.jsonl").read_text().splitlines()
    assert len(log) == 4 and '"unrolled"' in log[0]
    pipe.load_drafter(tmp_path / "a")
    images = random_images(3, seed=12)
    spec = pipe(images, max_new_tokens=8)
    plain = pipe(images, max_new_tokens=8, speculative=False)
    assert spec.texts == plain.texts and spec.stats.drafted_nodes > 0
    with pytest.raises(ValueError, match="holds a 'eagle' drafter"):
        train_drafter(TrainDrafterConfig(out=str(tmp_path / "b"), steps=5, **{**common, "drafter": "vispec"}), pipe=pipe)
    with pytest.raises(ValueError, match=r"of another run \(\['answer_tokens'\] differ: saved \{'answer_tokens': 6\}"):
        train_drafter(TrainDrafterConfig(out=str(tmp_path / "b"), steps=5, **{**common, "answer_tokens": 5}), pipe=pipe)
    with pytest.raises(ValueError, match="--drafter must be one of"):
        TrainDrafterConfig(pipeline="-", drafter="medusa", out="x")


def test_the_callers_target_keeps_its_flags_and_mode(setup, tmp_path):
    """Training froze (requires_grad False) and switched to eval mode the target of a pipeline
    the caller passed in, for good."""
    pipe, folder = setup
    params = list(pipe.target.parameters())
    original = [(p, p.requires_grad) for p in params], [(m, m.training) for m in pipe.target.modules()]
    frozen = params[0]
    before = [p.requires_grad for p in params]
    frozen.requires_grad_(not before[0])  # a mix of flags, to see each one restored
    before[0] = not before[0]
    pipe.target.train()
    pipe.target.get_input_embeddings().eval()  # a part kept in eval mode on purpose
    modes = [m.training for m in pipe.target.modules()]
    try:
        train_drafter(TrainDrafterConfig(pipeline="-", drafter="eagle", data=str(folder), answer_tokens=6, batch_size=2,
                                         lr=1e-3, steps=1, progress=False, out=str(tmp_path / "c")), pipe=pipe)
        assert [p.requires_grad for p in params] == before and not all(before) and any(before)
        assert [m.training for m in pipe.target.modules()] == modes and False in modes and True in modes
    finally:  # the fixture's state as this test found it
        for p, flag in original[0]:
            p.requires_grad_(flag)
        for m, mode in original[1]:
            m.training = mode



def test_a_resume_never_mixes_targets_answers_or_training_settings(setup, tmp_path):
    """An --out folder written for one target was resumed for another (its answers and head reused,
    silently); deleting data.pt as advised then resumed the old checkpoint on the new answers; a
    changed ttt_steps / ce_weight / batch size was taken without a word (text_layers: a raw
    RuntimeError). Each is refused by name."""
    import copy

    pipe, folder = setup
    common = dict(pipeline="-", drafter="eagle", data=str(folder), answer_tokens=6, batch_size=2, lr=1e-3,
                  save_every=1, progress=False)
    out = str(tmp_path / "r")
    train_drafter(TrainDrafterConfig(out=out, steps=1, **common), pipe=pipe)
    other = copy.deepcopy(pipe)
    with torch.no_grad():
        other.target.get_output_embeddings().weight.mul_(1.5)  # a fine-tune of the same architecture
    with pytest.raises(ValueError, match=r"\['target'\] differ.*delete data.pt and checkpoint.pt"):
        train_drafter(TrainDrafterConfig(out=out, steps=2, **common), pipe=other)
    for change in (dict(ttt_steps=2), dict(ce_weight=0.5), dict(batch_size=3)):
        with pytest.raises(ValueError, match=r"was trained with \{'%s': .*this run: \{'%s'" % (*change, *change)):
            train_drafter(TrainDrafterConfig(out=out, steps=2, **{**common, **change}), pipe=pipe)
    (tmp_path / "r" / "data.pt").unlink()  # answers to be regenerated for other settings: the old head would not fit
    with pytest.raises(ValueError, match=r"checkpoint.pt was trained on the answers of another run \(\['answer_tokens'\]"):
        train_drafter(TrainDrafterConfig(out=out, steps=2, **{**common, "answer_tokens": 5}), pipe=pipe)
    assert not (tmp_path / "r" / "data.pt").exists()  # refused before regenerating them
    assert len(train_drafter(TrainDrafterConfig(out=out, steps=2, **{**common, "answer_tokens": 6}),
                             pipe=pipe)["losses"]) == 1  # the same settings again: resumed (1 more step)


def test_llava_next_tiles_collate_and_text_drafters_need_a_causal_lm_class():
    from types import SimpleNamespace

    from conftest import tiny_qwen2vl_config
    from transformers import Qwen2VLForConditionalGeneration

    from mmspec.pipelines.train_drafter import check_text_drafter

    examples = [{"ids": torch.arange(3, 3 + n), "prompt_len": n - 1,
                 "inputs": {"pixel_values": torch.ones(1, tiles, 3, 4, 4), "image_sizes": torch.tensor([[8, 8 * tiles]])}}
                for n, tiles in ((5, 3), (4, 5))]
    ids, mask, inputs = collate(examples, 0)  # tile counts 3 and 5: torch.cat failed
    assert inputs["pixel_values"].shape == (2, 5, 3, 4, 4) and float(inputs["pixel_values"][0, 3:].abs().sum()) == 0
    assert torch.equal(inputs["pixel_values"][1], torch.ones(5, 3, 4, 4)) and inputs["image_sizes"].shape == (2, 2)
    qwen = Qwen2VLForConditionalGeneration(tiny_qwen2vl_config())
    with pytest.raises(ValueError, match="no causal-LM class for Qwen2VLTextConfig.*eagle or vispec"):
        check_text_drafter(qwen)
    check_text_drafter(SimpleNamespace(config=tiny_llava_parts()[0].config))  # LLaVA's Llama text config: fine


def test_loss_weights_and_learning_rate_are_refused_before_training():
    """A negative loss weight trained the head to increase that loss; two zero weights trained
    nothing; a negative or NaN lr failed in torch's optimiser after the data stage; a draft length
    of 0 was refused only when the trained drafter was saved."""
    for kwargs, message in ((dict(ce_weight=-1.0), "--feature-weight and --ce-weight must be finite, >= 0"),
                            (dict(feature_weight=float("nan")), "--feature-weight and --ce-weight"),
                            (dict(feature_weight=0.0, ce_weight=0.0), "not both 0"),
                            (dict(lr=-1e-3), "--lr must be a finite number > 0"),
                            (dict(lr=float("nan")), "--lr must be a finite number > 0"),
                            (dict(num_draft_tokens=0), "num_draft_tokens must be an int >= 1 or 'auto'"),
                            (dict(num_draft_tokens=True), "num_draft_tokens must be an int >= 1 or 'auto'"),
                            (dict(steps=2.5), "steps must be an int >= 1")):
        with pytest.raises(ValueError, match=message):
            TrainDrafterConfig(pipeline="-", drafter="eagle", out="x", **kwargs)
    # The text drafter trains on cross-entropy alone: the feature weights do not apply to it.
    TrainDrafterConfig(pipeline="-", drafter="text", out="x", feature_weight=0.0, ce_weight=0.0)
    TrainDrafterConfig(pipeline="-", drafter="eagle", out="x", feature_weight=0.0, ce_weight=1.0)


@pytest.mark.parametrize("kind", ["eagle", "vispec"])
def test_qwen2vl_teacher_and_collate(kind, tmp_path):
    """Qwen2-VL examples (flat pixel patches, image grids, per-token mm_token_type_ids) collate
    into a left-padded batch; the teacher's captured input embeddings carry the merged image
    features; the head's loss decreases on the batch."""
    from types import SimpleNamespace

    from test_vlm_qwen2vl import IMG, PATCH

    from conftest import tiny_qwen2vl_config
    from transformers import Qwen2VLForConditionalGeneration

    from mmspec.pipelines.train_drafter import teacher

    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(tiny_qwen2vl_config()).eval()
    g = torch.Generator().manual_seed(1)
    examples = []
    for n_before, (h, w) in [(2, (4, 4)), (5, (4, 6))]:
        ids = torch.cat([torch.randint(3, 50, (n_before,), generator=g), torch.tensor([58]),
                         torch.full(((h // 2) * (w // 2),), IMG), torch.tensor([59]), torch.randint(3, 50, (6,), generator=g)])
        examples.append({"ids": ids, "prompt_len": len(ids) - 3, "inputs": {
            "pixel_values": torch.randn(h * w, PATCH, generator=g), "image_grid_thw": torch.tensor([[1, h, w]]),
            "mm_token_type_ids": (ids[: len(ids) - 3] == IMG).int().unsqueeze(0)}})
    ids, mask, inputs = collate(examples, 0)
    assert inputs["mm_token_type_ids"].shape == ids.shape
    assert torch.equal(inputs["mm_token_type_ids"].bool(), (ids == IMG) & mask.bool())
    embeds, hidden, logits = teacher(model, ids, mask, inputs)
    merged = torch.cat(list(model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output))
    torch.testing.assert_close(embeds[ids == IMG], merged)
    pipe = SimpleNamespace(target=model)
    config = TrainDrafterConfig(pipeline="-", drafter=kind, out=str(tmp_path), lr=3e-3, progress=False)
    torch.manual_seed(0)
    drafter = new_drafter(pipe, config)
    optim = torch.optim.AdamW(drafter.parameters(), lr=config.lr)
    first = float(step_loss(pipe, drafter, (ids, mask, inputs), config)[0].detach())
    for _ in range(10):
        optim.zero_grad()
        step_loss(pipe, drafter, (ids, mask, inputs), config)[0].backward()
        optim.step()
    assert float(step_loss(pipe, drafter, (ids, mask, inputs), config)[0].detach()) < 0.7 * first



def test_learning_rate_schedules(setup, tmp_path):
    import math

    from mmspec.pipelines.train_config import lr_at

    const = TrainDrafterConfig(pipeline="-", drafter="eagle", out="x", lr=1e-3, steps=100, warmup_steps=4)
    assert [lr_at(const, s) for s in (0, 3)] == [pytest.approx(2e-4), pytest.approx(8e-4)]  # (s + 1) / 5 of lr
    assert lr_at(const, 4) == lr_at(const, 99) == 1e-3
    cos = TrainDrafterConfig(pipeline="-", drafter="eagle", out="x", lr=1e-3, steps=104, warmup_steps=4,
                             lr_schedule="cosine")
    assert lr_at(cos, 4) == pytest.approx(1e-3)  # the cosine starts at the peak after the warm-up
    assert lr_at(cos, 54) == pytest.approx(5e-4)  # half way through the 100 decaying steps: cos(pi/2) = 0
    assert lr_at(cos, 103) == pytest.approx(1e-3 * (1 - math.cos(math.pi / 100)) / 2)  # 1 step before 0
    assert all(lr_at(cos, s) > lr_at(cos, s + 1) for s in range(4, 103))
    with pytest.raises(ValueError, match="--lr-schedule must be one of"):
        TrainDrafterConfig(pipeline="-", drafter="eagle", out="x", lr_schedule="linear")
    with pytest.raises(ValueError, match="warmup_steps must be in"):
        TrainDrafterConfig(pipeline="-", drafter="eagle", out="x", steps=10, warmup_steps=10)
    # the optimiser runs the schedule (steps 0, 1, 2 at 1/2, 1, 1/2 of lr), and a cosine run resumed
    # with another length (another schedule) is refused
    pipe, folder = setup
    common = dict(pipeline="-", drafter="eagle", data=str(folder), answer_tokens=6, batch_size=2, lr=1e-3,
                  save_every=1, progress=False, lr_schedule="cosine", warmup_steps=1)
    train_drafter(TrainDrafterConfig(out=str(tmp_path / "c"), steps=3, **common), pipe=pipe)
    ckpt = torch.load(tmp_path / "c" / "checkpoint.pt", weights_only=False)
    assert ckpt["optim"]["param_groups"][0]["lr"] == pytest.approx(5e-4)
    with pytest.raises(ValueError, match=r"was trained with \{'steps': 3\}"):
        train_drafter(TrainDrafterConfig(out=str(tmp_path / "c"), steps=5, **common), pipe=pipe)


def test_a_malformed_scenes_index_is_refused_naming_file_and_line(tmp_path):
    """--data folders may carry `mmspec testbed data`'s scenes.jsonl; a broken line used to end the
    command with json's bare message (no file, no line)."""
    from mmspec.pipelines.train_drafter import data_items

    config = TrainDrafterConfig(pipeline="p", drafter="eagle", out="o", data=str(tmp_path))
    (tmp_path / "scenes.jsonl").write_text('{"image": "a.png", "qa": []}\n\n{broken\n')
    with pytest.raises(ValueError, match=r"scenes.jsonl line 3 is not JSON"):
        data_items(config)
    (tmp_path / "scenes.jsonl").write_text('{"image": "a.png"}\n{"qa": []}\n')
    with pytest.raises(ValueError, match=r"scenes.jsonl line 2 names no image"):
        data_items(config)
    (tmp_path / "scenes.jsonl").write_text('{"image": "a.png", "qa": [["what ?", "it"]]}\n{"image": "b.png"}\n')
    assert [p.name for p, _ in data_items(config)] == ["a.png", "b.png"]


def test_saved_tree_settings_are_checked_before_training_and_auto_is_accepted(tmp_path):
    """--tree-num-nodes takes an int or auto; a tree the drafter could not hold is refused when the
    options are read (before: after the whole training run, when the drafter was saved)."""
    from mmspec.cli import main

    with pytest.raises(SystemExit, match="exceeds"):
        main(["train-drafter", "--pipeline", "-", "--drafter", "eagle", "--out", str(tmp_path / "x"),
              "--tree-depth", "2", "--tree-top-k", "2", "--tree-num-nodes", "9"])
    with pytest.raises(SystemExit):  # argparse: neither an int nor auto
        main(["train-drafter", "--pipeline", "-", "--drafter", "eagle", "--out", str(tmp_path / "x"),
              "--tree-num-nodes", "many"])
    config = TrainDrafterConfig(pipeline="-", drafter="eagle", out="x", tree_depth=3, tree_top_k=2, tree_num_nodes="auto")
    assert config.tree_num_nodes == "auto"
    # --num-draft-tokens auto: its own error message offered it, argparse refused it as no int
    with pytest.raises(SystemExit):  # argparse: expected an int >= 1 (or auto)
        main(["train-drafter", "--pipeline", "-", "--drafter", "eagle", "--out", str(tmp_path / "x"),
              "--num-draft-tokens", "0"])
    with pytest.raises(SystemExit, match="not a folder|does not exist|no such"):  # accepted: fails on the pipeline
        main(["train-drafter", "--pipeline", str(tmp_path / "none"), "--drafter", "eagle", "--out",
              str(tmp_path / "x"), "--num-draft-tokens", "auto", "--no-progress"])
