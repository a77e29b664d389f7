"""`mmspec testbed compare-vlm`: paired comparison of two testbed VLMs on the same scenes."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from mmspec.testbed.vlm_compare import mcnemar_p, paired_comparison

VLM = str(Path(__file__).resolve().parents[1] / "assets" / "testbed" / "vlm")  # from any working directory


def test_mcnemar_exact_p_values():
    # Binomial(n, 1/2) tails written out by hand: P(X <= 1 | 10) = 11/1024, P(X <= 2 | 10) = 56/1024.
    assert mcnemar_p(1, 9) == pytest.approx(22 / 1024)
    assert mcnemar_p(8, 2) == pytest.approx(112 / 1024)
    assert mcnemar_p(0, 0) == 1.0 and mcnemar_p(5, 5) == 1.0
    assert mcnemar_p(0, 6) == pytest.approx(2 / 64)


def test_paired_difference_and_interval():
    a = [1, 1, 0, 0, 1]
    b = [1, 0, 1, 1, 1]
    r = paired_comparison(a, b)
    assert (r["only_a"], r["only_b"]) == (1, 2)
    assert r["a"] == pytest.approx(0.6) and r["b"] == pytest.approx(0.8) and r["difference"] == pytest.approx(0.2)
    half = 1.959964 * math.sqrt(3 - 1 / 5) / 5
    assert r["ci95"] == pytest.approx([0.2 - half, 0.2 + half])
    assert r["within_noise"]
    with pytest.raises(ValueError, match="equally long"):
        paired_comparison([1, 0], [1])


def test_a_real_difference_is_found_and_a_redraw_of_the_same_model_is_not():
    """Power: B right on 15 points more of 200 scenes is flagged; two models of the same
    accuracy that disagree on scattered scenes are within noise (fixed seed)."""
    rng = random.Random(0)
    a = [1] * 140 + [0] * 60
    b = [1] * 140 + [1] * 30 + [0] * 30  # B also right on half of A's misses
    r = paired_comparison(a, b)
    assert not r["within_noise"] and r["mcnemar_p"] < 1e-6
    twin = [x if rng.random() > 0.1 else 1 - x for x in a]  # ~10% of scenes flipped either way
    r = paired_comparison(a, twin)
    assert r["within_noise"] and r["mcnemar_p"] > 0.05


def test_compare_vlm_cli_on_the_bundle_against_itself(tmp_path, capsys):
    from mmspec.cli import main

    out = tmp_path / "cmp.json"
    assert main(["testbed", "compare-vlm", VLM, VLM, "--scenes", "4",
                 "--no-progress", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "captions" in text and "within noise" in text
    r = json.loads(out.read_text())
    for key in ("captions", "vqa"):
        assert r[key]["scenes"] == 4 and r[key]["only_a"] == r[key]["only_b"] == 0


def test_compare_vlm_refuses_bad_counts():
    from mmspec.cli import main
    from mmspec.testbed.vlm_compare import compare

    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="scenes"):
            compare(VLM, VLM, scenes=bad)
    with pytest.raises(SystemExit) as stop:  # an argument error (mmspec.cli_types.positive_int)
        main(["testbed", "compare-vlm", VLM, VLM, "--threads", "0"])
    assert stop.value.code == 2


def test_wilson_interval_matches_scipy():
    from scipy.stats import binomtest

    from mmspec.testbed.vlm_eval import wilson

    for k, n in ((159, 200), (0, 12), (12, 12), (1515, 2000)):
        ref = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
        assert wilson(k, n) == pytest.approx([ref.low, ref.high], abs=1e-6)
    assert wilson(0, 0) == [0.0, 1.0]  # no scenes: nothing known, not a division by zero


def test_eval_vlm_cli_reports_rates_with_intervals(tmp_path, capsys):
    """On the bundle's first 8 validation scenes, the figures of train-vlm's own checks
    (`vlm_eval.evaluate`, the same scenes), each with its 95% interval."""
    from mmspec.bench.vlm import load_pipeline
    from mmspec.cli import main
    from mmspec.testbed.vlm_eval import evaluate, scene_size
    from mmspec.testbed.world import World

    out = tmp_path / "eval.json"
    assert main(["testbed", "eval-vlm", "--scenes", "8", "--no-progress", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    r = json.loads(out.read_text())
    pipe = load_pipeline(VLM)
    ref = evaluate(pipe, World(seed=0, split="validation", image_size=scene_size(pipe.processor)).sample(8),
                   max_new_tokens=40, progress=False)
    assert r["caption_correct"] == ref["caption_correct"] and r["vqa_accuracy"] == ref["vqa_accuracy"]
    lo, hi = r["caption_correct_ci95"]
    assert 0 <= lo <= r["caption_correct"] <= hi <= 1 and "95% CI" in text
    with pytest.raises(SystemExit, match="--scenes must be >= 1"):
        main(["testbed", "eval-vlm", "--scenes", "0"])
