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
    ((_, controller),) = pipe._draft_length_controllers.values()
    assert len(controller.history) > 2 * out.stats.target_calls  # the steps of all three calls, one controller
    pipe.register_to_config(drafter_config={**pipe.config.drafter_config, "num_draft_tokens": "four"})
    with pytest.raises(ValueError, match=r"drafter_config\['num_draft_tokens'\] must be an int >= 0 or 'auto'"):
        pipe(LABELS.tolist(), guidance_scale=3.0, output_type="latent")


@pytest.mark.parametrize("window", [32, 2])
def test_guided_shadow_probes_keep_greedy_output_and_the_drafts_that_follow(window):
    """Shadow probes (mmspec/shadow_acceptance.py) through `GuidedModelDrafter` under CFG: greedy
    output equals the plain sampler's, each shadow reports flags for the rows' stretches (at
    most `window` a row), and the drafting steps after them accept exactly what they accept when
    the same steps are plain steps instead (the drafter caught up by the shadow drafts what one
    that catches up later does)."""
    from test_core_shadow import Scripted

    gpt = tiny_gpt(0)
    ref = plain_greedy(gpt, scale=3.0, schedule="linear")
    plan = [0, 0, 0, "s", 3, 0, 0, "s", 2, 0, "s", 0, 0, 4]
    runs = {}
    for name, steps in (("shadow", plan), ("plain", [0 if k == "s" else k for k in plan])):
        drafter = GuidedModelDrafter(LlamaGenSpec(noisy_gpt(gpt, 0.3)), cfg_schedule_fn("linear", 3.0, 16), "auto",
                                     make_uncond=null_class_uncond(NUM_CLASSES), max_draft_tokens=4)
        drafter.shadow_window = window
        drafter.controller = Scripted(steps)
        out = mmspec.speculative_generate(llamagen_target(gpt, 3.0, cfg_schedule="linear", num_tokens=16), drafter,
                                          LABELS.view(-1, 1), max_new_tokens=16, temperature=0)
        assert torch.equal(out.sequences[:, 1:], ref)
        runs[name] = drafter.controller.log
    shadows = [e[1] for e in runs["shadow"] if e[0] == "shadow"]
    assert len(shadows) >= 2 and all(len(h) <= window for hits in shadows for h in hits)
    assert max(len(h) for hits in shadows for h in hits) == min(window, 3)  # the first stretch: 3 plain steps
    accepted = {name: [e[1:3] for e in log if e[0] == "accepted" and e[1] > 0] for name, log in runs.items()}
    assert accepted["shadow"] == accepted["plain"] and sum(sum(a) for _, a in accepted["plain"]) > 0


def test_guided_runner_keeps_the_last_n_queries_with_their_own_guidance():
    """`last_only=n` (a shadow probe's catch-up) gives the last n columns of the full forward,
    each guided at its own position's scale (linear schedule: the scales differ by column)."""
    from mmspec.spec_target import chain_visibility

    gpt = tiny_gpt(0)
    drafter = GuidedModelDrafter(LlamaGenSpec(noisy_gpt(gpt, 0.3)), cfg_schedule_fn("linear", 3.0, 16), 2,
                                 make_uncond=null_class_uncond(NUM_CLASSES))
    ids = LABELS.view(-1, 1)
    drafter.runner.prefill(ids, torch.ones_like(ids), 40, {})
    tokens = torch.randint(0, 16, (ids.shape[0], 5), generator=torch.Generator().manual_seed(0))
    vis, depth = chain_visibility(ids.shape[0], 5, ids.device)
    full = drafter.runner.forward(tokens, depth, vis, 0, sees_region=True).logits  # nothing advanced: same state
    last3 = drafter.runner.forward(tokens, depth, vis, 0, last_only=3, sees_region=True).logits
    last1 = drafter.runner.forward(tokens, depth, vis, 0, last_only=True, sees_region=True).logits
    assert full.shape[1] == 5 and last3.shape[1] == 3
    torch.testing.assert_close(last3, full[:, -3:], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(last1, full[:, -1:], rtol=1e-12, atol=1e-12)


def test_runner_refuses_a_last_only_it_cannot_honour():
    from mmspec.spec_target import chain_visibility

    drafter = GuidedModelDrafter(LlamaGenSpec(noisy_gpt(tiny_gpt(0), 0.3)), cfg_schedule_fn("constant", 3.0, 16), 2,
                                 make_uncond=null_class_uncond(NUM_CLASSES))
    ids = LABELS.view(-1, 1)
    drafter.runner.prefill(ids, torch.ones_like(ids), 40, {})
    tokens = torch.zeros(ids.shape[0], 4, dtype=torch.long)
    vis, depth = chain_visibility(ids.shape[0], 4, ids.device)
    for bad in (0, 5, -1, 2.0):
        with pytest.raises(ValueError, match=r"last_only must be a bool or an int in 1\.\.4"):
            drafter.runner.forward(tokens, depth, vis, 0, last_only=bad, sees_region=True)


def test_per_row_unconditional_prompts_survive_a_deferred_prefill(target, good_drafter):
    """Under "auto" the drafter's prompt prefill waits for its first drafting step; rows that
    ended before it have left by then. `make_uncond` holding per-row prompts (the same callable
    GuidedTarget takes) is called once, with every row, when the request starts: it was called at
    the deferred prefill with fewer rows (a raw size error). Greedy output equals plain guided
    decoding (NullDrafter)."""
    from mmspec.adaptive import DraftLengthController
    from mmspec.drafters.null_drafter import NullDrafter

    from conftest import left_padded

    ids, mask = left_padded([5, 3, 4], seed=11)
    u_ids = torch.tensor([[0, 0, 1, 7, 8], [0, 0, 0, 1, 9], [0, 0, 0, 1, 4]])
    calls = []

    def make_uncond(input_ids, attention_mask, model_inputs):
        calls.append(input_ids.shape[0])
        return u_ids, (u_ids != 0).long(), model_inputs

    guided = mmspec.GuidedTarget(target, 3.0, make_uncond=make_uncond)
    plain = mmspec.speculative_generate(guided, NullDrafter(target.config.vocab_size), ids, mask, temperature=0,
                                        max_new_tokens=12).sequences
    eos = int(plain[1, ids.shape[1]])  # row 1 ends with its first token
    ref = mmspec.speculative_generate(guided, NullDrafter(target.config.vocab_size), ids, mask, temperature=0,
                                      max_new_tokens=12, eos_token_id=eos, pad_token_id=0).sequences
    drafter = GuidedModelDrafter(good_drafter, 3.0, "auto", max_draft_tokens=3, make_uncond=make_uncond)
    drafter.controller = DraftLengthController(3, warmup=(0, 0, 3, 3, 0, 2) * 3, probe_every=0)
    calls.clear()
    out = mmspec.speculative_generate(guided, drafter, ids, mask, temperature=0, max_new_tokens=12, eos_token_id=eos,
                                      pad_token_id=0)
    assert torch.equal(out.sequences, ref)
    assert calls == [3, 3]  # the target's and the drafter's, both with every row
    assert out.stats.new_tokens[1] == 1 and out.stats.accepted_drafts > 0
