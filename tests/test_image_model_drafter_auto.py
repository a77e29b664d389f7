"""The image pipeline's small-model drafter with `num_draft_tokens="auto"`: `GuidedModelDrafter`
drafts under CFG with K chosen before every step; greedy output equals the plain sampler's over
several requests, exact sampling is distributed like guided plain sampling, the pipeline keeps
what the controller learnt from call to call, and a bad setting is refused by name."""

from __future__ import annotations

import pytest
import torch

import mmspec
from mmspec.drafters import GuidedModelDrafter
from mmspec.models.llamagen_spec import LlamaGenSpec, cfg_schedule_fn, llamagen_target, null_class_uncond

from _llamagen_helpers import LABELS, NUM_CLASSES, noisy_gpt, plain_greedy, tiny_gpt
from test_core_sampling import chi_square_p
from test_jacobi_drafter import SAMPLES, SCALE, cfg_gpt, guided_joint, sample_counts_over_requests


@pytest.mark.parametrize("cfg", [(3.0, "constant"), (4.0, "linear")], ids=["cfg", "linear"])
def test_guided_auto_greedy_equals_plain_over_requests(cfg):
    gpt = tiny_gpt(0)
    scale, schedule = cfg
    ref = plain_greedy(gpt, scale=scale, schedule=schedule)
    drafter = GuidedModelDrafter(LlamaGenSpec(noisy_gpt(gpt, 0.3)), cfg_schedule_fn(schedule, scale, 16), "auto",
                                 make_uncond=null_class_uncond(NUM_CLASSES), max_draft_tokens=4)
    for _ in range(4):  # the controller's warm-up (K = 3, 1, 3), then its own choices, plain steps included
        out = mmspec.speculative_generate(llamagen_target(gpt, scale, cfg_schedule=schedule, num_tokens=16), drafter,
                                          LABELS.view(-1, 1), max_new_tokens=16, temperature=0)
        assert torch.equal(out.sequences[:, 1:], ref)
    assert drafter.controller.k_max == 4 and len(set(drafter.controller.history)) >= 2


def test_guided_auto_exact_sampling_matches_guided_joint():
    gpt = cfg_gpt()
    drafter = GuidedModelDrafter(LlamaGenSpec(noisy_gpt(gpt, 0.5)), SCALE, "auto", max_draft_tokens=3,
                                 make_uncond=null_class_uncond(NUM_CLASSES))
    counts, accepted = sample_counts_over_requests(gpt, drafter, 8)
    assert chi_square_p(counts, guided_joint(gpt, SCALE), SAMPLES) > 1e-4
    assert chi_square_p(counts, guided_joint(gpt, 1.0), SAMPLES) < 1e-6  # power
    assert len(set(drafter.controller.history)) >= 2 and accepted > 0


def test_pipeline_model_drafter_auto_keeps_its_controller_across_calls():
    from test_ar_image_pipeline import make_pipe

    pipe = make_pipe()
    pipe.register_to_config(drafter_config={**pipe.config.drafter_config, "num_draft_tokens": "auto"})
    ref = plain_greedy(pipe.target, scale=3.0)
    for _ in range(3):
        out = pipe(LABELS.tolist(), guidance_scale=3.0, temperature=0, output_type="latent")
        assert torch.equal(out.tokens, ref)
    (controller,) = pipe._draft_length_controllers.values()
    assert len(controller.history) > 2 * out.stats.target_calls  # the steps of all three calls, one controller
    pipe.register_to_config(drafter_config={**pipe.config.drafter_config, "num_draft_tokens": "four"})
    with pytest.raises(ValueError, match=r"drafter_config\['num_draft_tokens'\] must be an int >= 0 or 'auto'"):
        pipe(LABELS.tolist(), guidance_scale=3.0, output_type="latent")
