"""`mmspec caption`, `mmspec vqa` and `mmspec train-drafter` on a tiny saved LLaVA pipeline."""

from __future__ import annotations

import json

import pytest
import torch

from mmspec.cli import main
from mmspec.drafters import EagleHead, EagleHeadConfig
from mmspec.pipelines import DrafterComponent, SpeculativeVLMPipeline

from _vlm_helpers import random_images, tiny_llava_parts


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    model, processor = tiny_llava_parts(dtype=torch.float32)
    pipe = SpeculativeVLMPipeline(model, processor)
    torch.manual_seed(0)
    pipe.add_drafter("eagle", DrafterComponent.from_head(EagleHead(EagleHeadConfig.for_target(model)), 3))
    pipe.save_pretrained(d / "pipe")
    for i, im in enumerate(random_images(2, seed=2)):
        im.save(d / f"{i}.png")
    return d


def test_sampled_captions_with_invariant_acceptance_equal_plain_sampling(saved, capsys):
    args = ["caption", str(saved / "0.png"), str(saved / "1.png"), "--model", str(saved / "pipe"), "--compare",
            "--max-new-tokens", "8", "--temperature", "1.0", "--seed", "3"]
    assert main(args + ["--acceptance", "invariant", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["identical_to_plain"] is True
    main(args + ["--acceptance", "exact"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    # exact sampling draws other tokens for the seed; the line says why and what to use
    assert "identical" in line or "--acceptance invariant gives plain sampling's answers" in line
    with pytest.raises(SystemExit, match="not a known rule"):
        main(args + ["--acceptance", "nope"])


def test_caption_compare_json_reports_each_item(saved, capsys):
    code = main(["caption", str(saved / "0.png"), str(saved / "missing.png"), str(saved / "1.png"), "--model",
                 str(saved / "pipe"), "--compare", "--json", "--max-new-tokens", "6", "--batch-size", "2"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1  # one item failed
    items = report["items"]
    assert items[0]["answer"] and items[2]["answer"] and items[1]["answer"] is None
    assert "missing.png" in items[1]["error"]
    assert report["identical_to_plain"] is True and report["speedup"] > 0 and report["mean_accepted_length"] >= 1


def test_caption_compare_with_nothing_decoded_prints_no_speed_up(saved, capsys):
    """Every image missing, or --max-new-tokens 0: the speed-up is undefined and its formatting
    crashed with a TypeError traceback; the line now says n/a."""
    assert main(["caption", str(saved / "missing.png"), "--model", str(saved / "pipe"), "--compare"]) == 1
    assert "speed-up n/a (nothing decoded)" in capsys.readouterr().out
    assert main(["caption", str(saved / "0.png"), "--model", str(saved / "pipe"), "--compare", "--max-new-tokens", "0"]) == 0
    assert "speed-up n/a (nothing decoded)" in capsys.readouterr().out


def test_vqa_and_text_output(saved, capsys):
    code = main(["vqa", str(saved / "0.png"), "--question", "what colour is the circle ?", "--model",
                 str(saved / "pipe"), "--max-new-tokens", "5", "--compare"])
    out = capsys.readouterr().out
    assert code == 0
    assert "[what colour is the circle ?]:" in out and "mean accepted length" in out and "identical" in out
    with pytest.raises(SystemExit, match="--question is empty"):  # it was answered
        main(["vqa", str(saved / "0.png"), "--question", " ", "--model", str(saved / "pipe")])


def test_model_is_required_until_a_testbed_vlm_is_bundled(saved, monkeypatch):
    import mmspec.pipelines.vlm_cli as cli

    monkeypatch.setattr(cli, "BUNDLED_VLM", saved / "nothing-here")
    with pytest.raises(SystemExit, match="pass --model DIR"):
        main(["caption", str(saved / "0.png")])
    with pytest.raises(SystemExit, match="no drafter 'nope'"):
        main(["caption", str(saved / "0.png"), "--model", str(saved / "pipe"), "--drafter", "nope"])


def test_bad_values_are_refused_before_the_model_loads(tmp_path, capsys):
    """Checked first: --model names a folder that does not exist, so a refusal that came only after
    loading would be about the folder instead."""
    image, folder = str(tmp_path / "0.png"), str(tmp_path / "no-such-model")
    for flags, message in [(["--temperature", "-1"], "temperature must be"),
                           (["--temperature", "nan"], "temperature must be"),
                           (["--acceptance", "fast"], "acceptance='fast' is not a known rule"),
                           (["--acceptance", "continuous"], "verifies continuous tokens"),
                           (["--max-new-tokens", "-2"], "--max-new-tokens must be >= 0")]:
        with pytest.raises(SystemExit, match=message):
            main(["caption", image, "--model", folder, *flags])
    with pytest.raises(SystemExit):
        main(["vqa", image, "--question", "what?", "--model", folder, "--batch-size", "0"])
    assert "expected an int >= 1, got 0" in capsys.readouterr().err


def test_a_rule_needing_a_table_the_model_lacks_is_refused_with_the_usable_ones(saved):
    """--acceptance lantern was refused with advice to pass a rule object, which a CLI user cannot."""
    for rule, table in (("lantern", "codebook"), ("cluster_exact", "labels")):
        with pytest.raises(SystemExit, match=f"--acceptance {rule} needs a {table} table.*'exact', 'greedy', 'gsd'"):
            main(["caption", str(saved / "0.png"), "--model", str(saved / "pipe"), "--acceptance", rule])


def test_a_folder_of_another_kind_is_named(tmp_path):
    from pathlib import Path

    assets = Path(__file__).resolve().parents[1] / "assets" / "testbed"
    image = str(assets / "images" / "scene_00.png")
    with pytest.raises(SystemExit, match="holds a SpeculativeMARPipeline pipeline, not a SpeculativeVLMPipeline"):
        main(["caption", image, "--model", str(assets / "mar")])
    with pytest.raises(SystemExit, match="neither a saved SpeculativeVLMPipeline .* nor a transformers VLM"):
        main(["caption", image, "--model", str(assets / "imagegen")])  # transformers said "Unrecognized model"


def test_train_drafter_command(saved, tmp_path, capsys):
    code = main(["train-drafter", "--pipeline", str(saved / "pipe"), "--drafter", "vispec", "--out", str(tmp_path / "v"),
                 "--data", str(saved), "--steps", "2", "--batch-size", "2", "--answer-tokens", "4", "--no-progress"])
    assert code == 0 and "trained vispec drafter: loss" in capsys.readouterr().out
    code = main(["caption", str(saved / "0.png"), "--model", str(saved / "pipe"), "--drafter", str(tmp_path / "v"),
                 "--compare", "--json", "--max-new-tokens", "5"])
    assert code == 0 and json.loads(capsys.readouterr().out)["identical_to_plain"] is True
    with pytest.raises(SystemExit, match="--drafter must be one of"):
        main(["train-drafter", "--pipeline", "x", "--drafter", "medusa", "--out", str(tmp_path / "m")])


def test_train_drafter_help_describes_every_option(capsys):
    """`mmspec train-drafter --help` gives a line for every option of TrainDrafterConfig."""
    import dataclasses

    from mmspec.pipelines.train_config import HELP, TrainDrafterConfig

    names = {f.name for f in dataclasses.fields(TrainDrafterConfig)} - {"progress"}
    assert set(HELP) == names
    with pytest.raises(SystemExit):
        main(["train-drafter", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in names:
        assert "--" + name.replace("_", "-") in text
    assert "(a half cosine toward 0, reached at --steps) (default constant)" in text
    assert "examples per step, at most the number of examples (default 8)" in text
