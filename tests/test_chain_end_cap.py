"""A fixed-length `ModelDrafter` chain is held to what the request can still emit: a step emits
its accepted drafts and one more token, so with r tokens left at most r - 1 drafts can be used
(the longest row of the batch sets the chain). Longer chains in the last steps were drafted and
verified for nothing, and a request of one new token ran the drafter's prompt prefill for
nothing. Output is unchanged: greedy equals plain greedy decoding (float64, batched, ragged,
every request length from 1 to 9), and the exact-sampling law tests in test_core_sampling.py run
short requests through the cap."""

from __future__ import annotations

import pytest
import torch

import mmspec
from mmspec.drafters import ModelDrafter

from conftest import left_padded
from test_core_greedy import LENGTHS, reference
from test_vlm_llava import llava  # noqa: F401 (a fixture)


def test_perfect_drafter_drafts_only_what_can_be_emitted(target):
    ids, mask = left_padded([6])
    out = mmspec.speculative_generate(target, ModelDrafter(target, 5), ids, mask, temperature=0,
                                      max_new_tokens=4)
    assert torch.equal(out.sequences, reference(target, ids, mask, 4))
    # After the prefill's token 3 are left: 2 drafts (both accepted) and the bonus token end it.
    assert out.stats.nodes_per_step == [2]
    assert out.stats.draft_calls == 1 + 1 + 1  # prompt, root, draft 1 (the 5-chain made 1 + 5)
    assert out.stats.new_tokens == [4]


@pytest.mark.parametrize("n", [1, 2])
def test_one_or_two_new_tokens_run_no_drafter_forward(target, n):
    """One new token comes from the target's prefill; with two, the one step can use no draft."""
    ids, mask = left_padded(LENGTHS)
    drafter = ModelDrafter(target, 4)
    out = mmspec.speculative_generate(target, drafter, ids, mask, temperature=0, max_new_tokens=n)
    assert torch.equal(out.sequences, reference(target, ids, mask, n))
    assert out.stats.draft_calls == 0 and out.stats.nodes_per_step == [0] * (n - 1)
    # the drafter is still usable for a longer request afterwards
    out = mmspec.speculative_generate(target, drafter, ids, mask, temperature=0, max_new_tokens=6)
    assert torch.equal(out.sequences, reference(target, ids, mask, 6))


@pytest.mark.parametrize("n", range(1, 10))
def test_batched_greedy_equals_plain_at_every_length(target, good_drafter, n):
    ids, mask = left_padded(LENGTHS)
    out = mmspec.speculative_generate(target, ModelDrafter(good_drafter, 5), ids, mask, temperature=0,
                                      max_new_tokens=n)
    assert torch.equal(out.sequences, reference(target, ids, mask, n))
    # no step drafts more than n - 2 (the room after the prefill's token), and the first step
    # exactly that when the chain is longer
    if n >= 2:
        assert out.stats.nodes_per_step[0] == min(5, n - 2)
    assert max(out.stats.nodes_per_step, default=0) <= max(n - 2, 0)

def test_sampled_rows_emit_exactly_max_new_tokens(target, good_drafter):
    ids, mask = left_padded(LENGTHS)
    g = torch.Generator().manual_seed(0)
    out = mmspec.speculative_generate(target, ModelDrafter(good_drafter, 6), ids, mask, temperature=1.0,
                                      max_new_tokens=7, generator=g)
    assert out.stats.new_tokens == [7] * len(LENGTHS)
    assert out.stats.nodes_per_step[0] == 5 and max(out.stats.nodes_per_step) <= 5


@pytest.mark.parametrize("kind, K", [("eagle", 5), ("vispec", 4), ("flash", 3)])
def test_head_drafter_chains_are_held_too(llava, kind, K):
    """The EAGLE / ViSpec / FLASH heads' fixed chains get the same cap (LLaVA batch of 4, ragged,
    a row ending at EOS): output equals plain greedy decoding row by row, no step drafts more
    than the loop's cap, the cap bit in the last steps, and K comes back for the next request."""
    from mmspec.drafters import EagleHeadDrafter, FlashDrafter, ViSpecDrafter

    from _eagle_helpers import llava_test_head
    from test_drafters_eagle import greedy_rows_equal_plain

    model, _ = llava
    config = dict(slots=3, compress_len=2) if kind == "flash" else {}
    head = llava_test_head(model, kind, **config)
    drafter = {"eagle": EagleHeadDrafter, "vispec": ViSpecDrafter, "flash": FlashDrafter}[kind](model, head, K)
    caps = []
    cap = drafter.cap_draft_length
    drafter.cap_draft_length = lambda n: (caps.append(n), cap(n))[1]
    for _ in range(2):  # a second request starts again from the fixed K
        caps.clear()
        out = greedy_rows_equal_plain(model, drafter)
        steps = out.stats.nodes_per_step
        assert len(caps) == len(steps) and all(n <= min(K, c) for n, c in zip(steps, caps))
        assert steps[0] == K and min(caps) < K and out.stats.accepted_drafts > 0
