"""The bundled testbed MAR pair (assets/testbed/mar): it loads strictly, is stored fp16, its plain
samples are recognisable to the judge, and CSpD runs on it and counts what it did."""

from __future__ import annotations

import json

import torch

from mmspec.pipelines.mar_cli import BUNDLED_MAR, is_mar_folder, load_mar, mar_defaults
from mmspec.testbed.imagegen_train import judge_breakdown
from mmspec.testbed.judge_model import JUDGE_DIR, Judge


def test_bundled_pair_is_fp16_with_its_metrics():
    from mmspec.pipelines import SpeculativeMARPipeline

    assert is_mar_folder(BUNDLED_MAR)
    pipe = SpeculativeMARPipeline.from_pretrained(str(BUNDLED_MAR))
    from safetensors.torch import load_file

    for comp in ("transformer", "drafter", "vae"):  # stored fp16
        weights = load_file(str(next((BUNDLED_MAR / comp).glob("*.safetensors"))))
        assert {t.dtype for t in weights.values()} == {torch.float16}, comp
    n_t = sum(p.numel() for p in pipe.transformer.parameters())
    n_d = sum(p.numel() for p in pipe.drafter.parameters())
    assert n_d < n_t / 2  # the drafter is the smaller model
    metrics = json.loads((BUNDLED_MAR / "metrics.json").read_text())
    assert metrics["config"]["main_position"] == "centre"
    assert (BUNDLED_MAR / "contact_sheet.png").is_file()


def test_bundled_plain_samples_are_recognisable():
    # one image per class at the folder's defaults; the recorded evaluation (256 images) found
    # 59.0%; with 32 images the standard error is ~0.09, so a bound 3.5 of those below it
    # fails only for a model that lost its classes (chance is 1/32)
    pipe = load_mar(BUNDLED_MAR)
    call = mar_defaults(BUNDLED_MAR, pipe)
    labels = list(range(32))
    out = pipe(labels, **call, speculative=False, generator=torch.Generator().manual_seed(11), output_type="pt")
    score = judge_breakdown(Judge.from_pretrained(str(JUDGE_DIR)), out.images.float() * 2 - 1, torch.tensor(labels), 8)
    recorded = json.loads((BUNDLED_MAR / "metrics.json").read_text())["plain"]["accuracy"]
    assert recorded > 0.5  # the 256-image evaluation stored with the folder
    assert score["accuracy"] >= recorded - 3.5 * (recorded * (1 - recorded) / 32) ** 0.5, score


def test_cspd_on_the_bundled_pair_counts_what_it_did():
    pipe = load_mar(BUNDLED_MAR)
    call = mar_defaults(BUNDLED_MAR, pipe)
    out = pipe([1, 9], **call, generator=torch.Generator().manual_seed(0), output_type="pt")
    s = out.stats
    assert out.images.shape == (2, 3, 64, 64) and torch.isfinite(out.images).all()
    assert s.spec.draft_calls > 0 and 0 < s.spec.target_calls <= call["num_iter"]
    assert s.judged_tokens <= s.drafted_tokens and s.accepted_tokens <= s.judged_tokens
    # every judged token is either accepted or replaced from the residual
    assert s.accepted_tokens + s.residual_tokens == s.judged_tokens
