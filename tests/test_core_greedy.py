"""Greedy speculative decoding must reproduce plain greedy decoding token for token."""

from __future__ import annotations

import pytest
import torch

import mmspec
from mmspec.drafters import ModelDrafter

from conftest import left_padded

LENGTHS = [9, 5, 7, 3]
TREES = [None, mmspec.TreeConfig(depth=3, top_k=3, num_nodes=8), mmspec.TreeConfig(depth=4, top_k=2, num_nodes=12)]


def reference(model, ids, mask, n, eos=None):
    return model.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n, pad_token_id=0,
        eos_token_id=eos, min_new_tokens=0,
    )


@pytest.mark.parametrize("tree", TREES, ids=["chain", "tree3x3", "tree4x2"])
@pytest.mark.parametrize("which", ["weak", "good", "perfect"])
def test_greedy_equals_generate(target, weak_drafter, good_drafter, tree, which):
    drafter_model = {"weak": weak_drafter, "good": good_drafter, "perfect": target}[which]
    ids, mask = left_padded(LENGTHS)
    ref = reference(target, ids, mask, 24)
    out = mmspec.speculative_generate(
        target, (ModelDrafter(drafter_model, tree=tree) if tree else ModelDrafter(drafter_model, 4)), ids, mask,
        temperature=0, max_new_tokens=24, pad_token_id=0,
    )
    assert torch.equal(out.sequences, ref)
    assert out.stats.new_tokens == [24] * 4


def test_perfect_chain_drafter_is_accepted_in_full(target):
    ids, mask = left_padded(LENGTHS)
    out = mmspec.speculative_generate(
        target, ModelDrafter(target, num_draft_tokens=4), ids, mask, temperature=0, max_new_tokens=21
    )
    # 1 prefill token + 4 steps of 5 tokens: every draft accepted, no extra step.
    assert out.stats.target_calls == 4
    assert out.stats.mean_accepted_length == 5.0
    assert out.stats.acceptance_rate_per_position == [1.0, 1.0, 1.0, 1.0]


def test_perfect_tree_drafter_accepts_its_depth(target):
    ids, mask = left_padded(LENGTHS)
    tree = mmspec.TreeConfig(depth=3, top_k=2, num_nodes=2 + 2 * 4)  # the whole pool is kept
    out = mmspec.speculative_generate(target, ModelDrafter(target, tree=tree), ids, mask, temperature=0, max_new_tokens=17)
    assert out.stats.mean_accepted_length == 4.0


def test_good_drafter_accepts_some_but_not_all(target, good_drafter):
    ids, mask = left_padded(LENGTHS)
    out = mmspec.speculative_generate(
        target, ModelDrafter(good_drafter, num_draft_tokens=4), ids, mask, temperature=0, max_new_tokens=24
    )
    assert 1.3 < out.stats.mean_accepted_length < 5.0


def test_batched_equals_per_row(target, good_drafter):
    ids, mask = left_padded(LENGTHS)
    tree = mmspec.TreeConfig(depth=3, top_k=3, num_nodes=8)
    batched = mmspec.speculative_generate(
        target, ModelDrafter(good_drafter, tree=tree), ids, mask, temperature=0, max_new_tokens=16
    ).sequences
    for b, n in enumerate(LENGTHS):
        row = ids[b : b + 1, ids.shape[1] - n :]
        single = mmspec.speculative_generate(
            target, ModelDrafter(good_drafter, tree=tree), row, temperature=0, max_new_tokens=16
        ).sequences
        assert torch.equal(single[0, n:], batched[b, ids.shape[1] :])


def test_eos_and_max_new_tokens_per_row(target, good_drafter):
    ids, mask = left_padded(LENGTHS)
    free = reference(target, ids, mask, 24)[:, ids.shape[1] :]
    # Pick as EOS a token that row 0 emits early; rows end at different steps.
    eos = int(free[0, 3])
    ref = reference(target, ids, mask, 24, eos=eos)
    out = mmspec.speculative_generate(
        target, ModelDrafter(good_drafter, num_draft_tokens=3), ids, mask, temperature=0,
        max_new_tokens=24, eos_token_id=eos, pad_token_id=0,
    )
    assert torch.equal(out.sequences, ref)
    new = out.sequences[:, ids.shape[1] :]
    for b in range(len(LENGTHS)):
        hits = (new[b] == eos).nonzero()
        expected = int(hits[0]) + 1 if len(hits) else 24
        assert out.stats.new_tokens[b] == expected
        assert (new[b, expected:] == 0).all()
    # Finished rows leave the working batch: the per-step row counts fall as rows end.
    rows = out.stats.active_rows
    assert len(rows) == out.stats.target_calls and sum(rows) == out.stats.row_steps
    assert rows[0] == len(LENGTHS) and rows[-1] < rows[0] and rows == sorted(rows, reverse=True)


def test_drafter_that_proposes_nothing(target):
    ids, mask = left_padded(LENGTHS)
    out = mmspec.speculative_generate(
        target, ModelDrafter(target, num_draft_tokens=0), ids, mask, temperature=0, max_new_tokens=10
    )
    assert torch.equal(out.sequences, reference(target, ids, mask, 10))
    assert out.stats.target_calls == 9 and out.stats.mean_accepted_length == 1.0


def test_max_new_tokens_zero_and_one(target):
    ids, mask = left_padded(LENGTHS)
    zero = mmspec.speculative_generate(target, ModelDrafter(target, 2), ids, mask, temperature=0, max_new_tokens=0)
    assert torch.equal(zero.sequences, ids)
    one = mmspec.speculative_generate(target, ModelDrafter(target, 2), ids, mask, temperature=0, max_new_tokens=1)
    assert torch.equal(one.sequences, reference(target, ids, mask, 1))


def test_perfect_chain_drafter_without_padding_drafts_mask_free_and_is_accepted_in_full(target, monkeypatch):
    """Unpadded rows of equal length: the drafter's chain steps (one token that sees the whole
    uncommitted region) take RaggedKV's mask-free path, and a drafter that is the target still
    drafts the target's own tokens there."""
    from mmspec.ragged import RaggedKV

    full = []
    plan = RaggedKV.plan

    def recording(self, *args, **kwargs):
        attention = plan(self, *args, **kwargs)
        full.append((args[2], attention.full))  # (tokens already in the region, mask-free?)
        return attention

    monkeypatch.setattr(RaggedKV, "plan", recording)
    ids, mask = left_padded([8, 8])
    out = mmspec.speculative_generate(target, ModelDrafter(target, num_draft_tokens=4), ids, mask, temperature=0,
                                      max_new_tokens=21)
    assert torch.equal(out.sequences, reference(target, ids, mask, 21))
    assert out.stats.mean_accepted_length == 5.0
    assert any(t > 0 and f for t, f in full), "chain steps past the first draft ran without a mask"
