"""The testbed VLM's look-up tuning stage (mmspec/testbed/vlm_tune.py): its mix draws existence
questions at the asked share, it keeps the LM stage's model and starts every rerun from it,
0 steps leaves that model unchanged, and bad settings are refused."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from mmspec.testbed.vlm_eval import question_kind
from mmspec.testbed.vlm_train import VLMTrainConfig, build_processor
from mmspec.testbed.vlm_train import sample_examples
from mmspec.testbed.world import World

TINY = ["--n-train", "16", "--n-val", "2", "--tower-steps", "2", "--tower-layers", "1", "--lm-steps", "2",
        "--lm-layers", "1", "--lm-batch", "4", "--tune-steps", "3", "--no-progress"]


def _kinds(examples, tok):
    return [question_kind(tok.decode(p).rsplit(" :", 1)[0]) for _, p, _ in examples]


def test_tune_mix_draws_existence_questions_at_the_asked_share():
    tok = build_processor(VLMTrainConfig()).tokenizer
    scenes = World(seed=0, split="train").sample(600)
    data = {"captions": [s.captions for s in scenes], "qa": [s.qa for s in scenes]}
    # P(existence question) per scene = f + (1 - f) * (its share of existence questions), when it has one
    base = [sum(question_kind(q) == "exists" for q, _ in s.qa) / len(s.qa) for s in scenes]
    for f in (0.5, 0.0):
        ex = sample_examples(data, tok, random.Random(0), 0.0, f)
        assert [i for i, _, _ in ex] == list(range(len(scenes)))
        kinds = _kinds(ex, tok)
        assert "other" not in kinds  # every prompt decodes back to one of the grammar's questions
        p = [(f + (1 - f) * b) if b > 0 else 0.0 for b in base]
        mean, sd = sum(p), math.sqrt(sum(q * (1 - q) for q in p))
        assert abs(kinds.count("exists") - mean) < 4 * sd, (f, kinds.count("exists"), mean, sd)
    # power: the two mixes' expected counts lie > 8 sd apart, so a mix ignoring f would fail above
    p_half = [(0.5 + 0.5 * b) if b > 0 else 0.0 for b in base]
    assert sum(p_half) - sum(base) > 8 * math.sqrt(sum(q * (1 - q) for q in p_half))
    # the LM stage draws the same mix from its own setting (lm_exists_fraction)
    from mmspec.testbed.vlm_train import encode_examples

    lm = encode_examples(data, tok, random.Random(0), VLMTrainConfig(caption_fraction=0.0, lm_exists_fraction=0.5))
    assert lm == sample_examples(data, tok, random.Random(0), 0.0, 0.5)
    assert abs(_kinds(lm, tok).count("exists") - sum(p_half)) < 4 * math.sqrt(sum(q * (1 - q) for q in p_half))
    # captions at caption_fraction = 1, answers end with EOS
    ex = sample_examples(data, tok, random.Random(0), 1.0, 0.5)
    assert all(tok.decode(p).startswith("what is in the image") for _, p, _ in ex)
    assert all(a[-1] == tok.eos_token_id for _, _, a in ex)


def _weights(folder):
    from safetensors.torch import load_file

    return {k: v for f in sorted((folder / "target").glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_tune_stage_keeps_the_lm_model_and_reruns_from_it(tmp_path):
    from mmspec.cli import main

    out, work = tmp_path / "vlm", tmp_path / "work"
    args = ["testbed", "train-vlm", "--out", str(out), "--work", str(work), *TINY]
    stale = work / "drafter_data.pt"  # drafter data regenerated from an older target must not survive
    work.mkdir()
    stale.write_bytes(b"old target")
    assert main([*args, "--stages", "data,tower,lm"]) == 0
    assert not stale.exists()
    stale.write_bytes(b"old target")
    assert main([*args, "--stages", "tune"]) == 0
    assert not stale.exists()
    first = json.loads((work / "metrics.json").read_text())["tune"]
    assert first["steps"] == 3 and first["source"].endswith("pipeline_lm")
    log = json.loads((work / "train_log.json").read_text())["tune"]
    assert len(log) == 2 and all(math.isfinite(r["loss"]) for r in log)
    lm, tuned = _weights(work / "pipeline_lm"), _weights(work / "pipeline")
    lang = [k for k in lm if "language_model" in k]
    tower = [k for k in lm if "vision_tower" in k]
    assert lang and tower
    assert any(not torch.equal(lm[k], tuned[k]) for k in lang)  # the LM trained
    assert all(torch.equal(lm[k], tuned[k]) for k in tower)  # the tower stayed frozen
    # a rerun starts from the LM stage's model again, not from the tuned one: same first loss
    assert main([*args, "--stages", "tune"]) == 0
    again = json.loads((work / "train_log.json").read_text())["tune"]
    assert again[0]["loss"] == log[0]["loss"]
    # 0 steps: the drafters and eval read the LM stage's model unchanged
    stale.write_bytes(b"old target")
    assert main([*args, "--stages", "tune", "--tune-steps", "0"]) == 0
    assert not stale.exists()
    plain = _weights(work / "pipeline")
    assert all(torch.equal(lm[k], plain[k]) for k in lm)
    with pytest.raises(SystemExit, match="not a saved pipeline"):
        main([*args, "--stages", "tune", "--tune-from", str(tmp_path)])


@pytest.mark.parametrize("bad", [{"tune_steps": -1}, {"tune_lr": 0.0}, {"tune_exists_fraction": 1.5},
                                 {"lm_exists_fraction": -0.1}])
def test_tune_settings_are_checked(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        VLMTrainConfig(**bad)


def test_tune_without_an_lm_stage_says_what_to_run(tmp_path):
    from mmspec.testbed.vlm_tune import stage_tune

    with pytest.raises(FileNotFoundError, match="--stages lm"):
        stage_tune(VLMTrainConfig(), tmp_path, {})
