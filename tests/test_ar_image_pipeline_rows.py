"""`SpeculativeARImagePipeline` details no other test pinned (each found by a mutant that the
suite let through): the CFG null class is not a label, a callback stop after a row finished
keeps every image's tokens in its own slot, a drafter GPT drafts under the target's guidance,
and a VQ folder loads in the dtype asked for."""

from __future__ import annotations

import pytest
import torch

from mmspec.assets_dir import ASSETS
from mmspec.models.llamagen_vq_model import LlamaGenVQModel
from mmspec.pipelines import SpeculativeARImagePipeline

from _llamagen_helpers import LABELS, NUM_CLASSES, noisy_gpt, plain_greedy, tiny_gpt
from test_ar_image_pipeline import make_pipe, tiny_vq


def test_the_null_class_is_not_a_label():
    pipe = make_pipe(torch.float32)
    with pytest.raises(ValueError, match="unknown class id"):  # it would decode an unconditional image
        pipe([NUM_CLASSES], guidance_scale=3.0)


def test_a_stop_after_a_row_finished_keeps_every_image_in_its_own_slot():
    pipe = make_pipe()
    log = []

    def stop_after_first_image(p, step, done, kw):
        log.append(list(kw["num_tokens"]))
        first = next((i for i, n in enumerate(log) if 16 in n), None)
        return {"stop": first is not None and step - 1 > first and sum(c == 16 for c in kw["num_tokens"]) < 4}

    out = pipe(LABELS.tolist(), guidance_scale=3.0, temperature=0, output_type="latent",
               callback_on_step_end=stop_after_first_image)
    counts = log[-1]
    assert out.interrupted and 16 in counts and min(counts) < 16  # a row had left the batch; one had not finished
    assert counts == out.stats.new_tokens == (out.tokens >= 0).sum(1).tolist()
    full = plain_greedy(pipe.target, scale=3.0)
    for b in range(4):
        assert torch.equal(out.tokens[b, :counts[b]], full[b, :counts[b]])


@pytest.mark.parametrize("schedule", ["constant", "linear"])
def test_a_drafter_gpt_drafts_under_the_targets_guidance(schedule):
    """A drafter identical to the target, guided as the target is (the same scale at the same
    token index), has every draft accepted at temperature 0; drafting unguided, or one token off
    the linear schedule, it has not."""
    target = tiny_gpt(0)
    pipe = SpeculativeARImagePipeline(target=target, vq=tiny_vq(), drafter=noisy_gpt(target, 0.0))
    pipe.set_progress_bar_config(disable=True)
    out = pipe(LABELS.tolist(), guidance_scale=4.0, cfg_schedule=schedule, temperature=0, output_type="latent")
    assert out.stats.drafter.startswith("GuidedModelDrafter")
    assert out.stats.accepted_drafts == out.stats.drafted_nodes > 0
    assert torch.equal(out.tokens, plain_greedy(target, scale=4.0, schedule=schedule))


def test_a_vq_folder_loads_in_the_dtype_asked_for():
    bundle = ASSETS / "testbed" / "imagegen"
    pipe = SpeculativeARImagePipeline.from_pretrained(bundle, dtype=torch.bfloat16)
    assert pipe.vq.dtype == torch.bfloat16 and pipe.target.dtype == torch.bfloat16
    assert LlamaGenVQModel.from_pretrained(bundle / "vq", torch_dtype=torch.float16).dtype == torch.float16
    assert LlamaGenVQModel.from_pretrained(bundle / "vq", dtype=torch.float64).dtype == torch.float64
