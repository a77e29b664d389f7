"""Drafter training details that mutants of session 61 showed no test pinned: a run whose steps are
not a multiple of save_every still saves its last step (a rerun trains nothing), data made for
other settings is refused without a checkpoint beside it, and the text drafter's loss leaves out
the pairs whose next token is an image token."""

from __future__ import annotations

import json

import pytest
import torch

from mmspec.pipelines import SpeculativeVLMPipeline
from mmspec.pipelines.train_drafter import TrainDrafterConfig, text_loss, train_drafter

from _vlm_helpers import random_images, tiny_llava_parts


def _setup(tmp_path):
    model, processor = tiny_llava_parts(dtype=torch.float32)
    folder = tmp_path / "img"
    folder.mkdir()
    for i, image in enumerate(random_images(2, seed=11)):
        image.save(folder / f"{i}.png")
    return SpeculativeVLMPipeline(model, processor), dict(pipeline="-", drafter="eagle", data=str(folder),
                                                          batch_size=2, progress=False, out=str(tmp_path / "o"))


def test_the_last_step_is_saved_and_other_settings_data_is_refused(tmp_path):
    pipe, cfg = _setup(tmp_path)
    train_drafter(TrainDrafterConfig(steps=3, answer_tokens=4, save_every=2, **cfg), pipe=pipe)
    assert torch.load(tmp_path / "o" / "checkpoint.pt", weights_only=False)["step"] == 3
    again = train_drafter(TrainDrafterConfig(steps=3, answer_tokens=4, save_every=2, **cfg), pipe=pipe)
    assert len(again["losses"]) == 0
    lines = (tmp_path / "o" / "train_log.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    (tmp_path / "o" / "checkpoint.pt").unlink()  # e.g. a run interrupted before its first save
    with pytest.raises(ValueError):
        train_drafter(TrainDrafterConfig(steps=1, answer_tokens=6, **cfg), pipe=pipe)


def test_the_text_loss_leaves_out_pairs_before_an_image_token():
    image = 60
    ids = torch.tensor([[3, 5, 60, 60, 7, 8, 9]])
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(1, 7, 64, generator=g)

    class Student:  # exact on text pairs, garbage where the next token is the image token
        def __call__(self, input_ids, attention_mask):
            out = teacher.clone()
            out[0, :-1][input_ids[0, 1:] == image] = 5 * torch.randn(64, generator=g)
            return type("Out", (), {"logits": out})()

    loss, _ = text_loss(Student(), ids, torch.ones_like(ids), teacher, image)
    assert float(loss) < 1e-6
