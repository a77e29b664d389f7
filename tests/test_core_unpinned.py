"""Core behaviour that mutants of session 61 showed no test pinned: deep narrow trees, sliding
windows on unpadded one-token steps, padded prefills of eager models, a static cache at a tight
capacity bound, tree offers counted by depth, top-p keeping the argmax, a self-parent tree
refused, the pad-slot scrub, the stats' fallback denominator, the end cap following the longest
row."""

from __future__ import annotations

import pytest
import torch

import mmspec
from mmspec.drafters import ModelDrafter

from conftest import left_padded, noisy_copy
from test_core_hardening import plain_greedy, windowed


def _generate(model, ids, mask, n):
    return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n, pad_token_id=0,
                          eos_token_id=None)


def test_deep_narrow_trees_see_the_root_from_every_node(target, good_drafter):
    from mmspec.tree import ancestors, chain_parents

    for n in range(1, 17):  # a chain given as a tree: verify position i sees positions 0 (the root) .. i
        assert torch.equal(ancestors(chain_parents(1, n))[0], torch.ones(n + 1, n + 1, dtype=torch.bool).tril())
    ids, mask = left_padded([9, 5, 7, 3])
    ref = _generate(target, ids, mask, 20)
    for model in (good_drafter, target):
        for tree in (mmspec.TreeConfig(depth=6, top_k=1, num_nodes=6), mmspec.TreeConfig(depth=6, top_k=2, num_nodes=7)):
            out = mmspec.speculative_generate(target, ModelDrafter(model, tree=tree), ids, mask, temperature=0,
                                              max_new_tokens=20, pad_token_id=0)
            assert torch.equal(out.sequences, ref)


@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_sliding_windows_hold_on_unpadded_one_token_steps(name):
    model = windowed(name)
    ids, mask = left_padded([10])  # one unpadded row: a one-token step may run maskless only without a window
    ref = plain_greedy(model, ids, mask, 12)
    for k in (0, 3):
        out = mmspec.speculative_generate(model, ModelDrafter(model, k), ids, mask, temperature=0, max_new_tokens=12)
        assert torch.equal(out.sequences[:, ids.shape[1]:], ref)


def test_padded_prefill_of_an_eager_model_decodes_every_row():
    """Eager attention leaves a fully masked pad query NaN; the prefill's own mask must not."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                                         attn_implementation="eager")).double().eval()
    ids, mask = left_padded([9, 5, 7, 3])
    out = mmspec.speculative_generate(model, ModelDrafter(model, 3), ids, mask, temperature=0, max_new_tokens=8)
    assert torch.equal(out.sequences[:, -8:], plain_greedy(model, ids, mask, 8))


def test_a_static_cache_at_a_tight_capacity_bound_keeps_finished_rows_inside(target, good_drafter):
    from mmspec.models.hf_target import HFTarget

    static = HFTarget(target, static=True)
    for seed in range(6):
        for k in (6, 8):
            n = 64 - 9 - k - 2  # prompt + max_new_tokens + K + 2 = 64: the bound lands on a 64-slot bucket
            ids, mask = left_padded([9, 4, 7], seed=seed)
            out = mmspec.speculative_generate(static, ModelDrafter(good_drafter, k), ids, mask, temperature=0,
                                              max_new_tokens=n)
            assert torch.equal(out.sequences, _generate(target, ids, mask, n)), (seed, k)


def test_a_perfect_tree_is_offered_and_accepted_at_each_of_its_depths(target):
    ids, mask = left_padded([9, 5, 7, 3])
    tree = mmspec.TreeConfig(depth=3, top_k=2, num_nodes=10)
    out = mmspec.speculative_generate(target, ModelDrafter(target, tree=tree), ids, mask, temperature=0,
                                      max_new_tokens=17)
    assert out.stats.acceptance_rate_per_position == [1.0, 1.0, 1.0]


def test_a_tiny_top_p_keeps_the_most_likely_token():
    from mmspec.sampling import SamplingConfig, process_logits

    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(0))
    p = process_logits(logits, SamplingConfig(temperature=1.0, top_p=1e-9))
    assert torch.equal(p, torch.nn.functional.one_hot(logits.argmax(-1), 40).float())


def test_a_node_that_is_its_own_parent_is_refused():
    from mmspec.acceptance import get_rule
    from mmspec.tree import parents_precede_children, verify_tree

    assert not parents_precede_children(torch.tensor([[-1, 1, 0]]))
    with pytest.raises(ValueError, match="parents"):
        verify_tree(get_rule("exact"), torch.tensor([[5, 6]]), torch.tensor([[-1, 1]]),
                    torch.full((1, 3, 40), 1 / 40, dtype=torch.float64))


def test_pad_slots_are_scrubbed_after_the_prefill():
    from mmspec.ragged import RaggedKV

    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    kv = RaggedKV(1, mask, max_slots=8)
    kv.plan_prefill(mask)
    k = torch.randn(2, 1, 3, 4, dtype=torch.float64)
    k[0, :, 0] = float("nan")  # what a prefill may leave in a pad slot
    kv.update(0, k, k.clone())
    kv.scrub_padding()
    assert bool(torch.isfinite(kv.keys[0][0, :, 0]).all() and torch.isfinite(kv.values[0][0, :, 0]).all())


def test_per_position_rates_without_offer_counts_divide_by_row_steps():
    from mmspec.stats import SpecStats

    rates = SpecStats(target_calls=3, row_steps=6, accept_counts=[3, 1]).acceptance_rate_per_position
    assert rates == pytest.approx([0.5, 1 / 3])


def test_the_end_cap_follows_the_row_with_the_most_tokens_left(target):
    """Rows that drifted apart: the chain is capped at what the longest row can still use, so no
    step drafts nothing while a row has two or more tokens to go (only the last step may)."""
    ids, mask = left_padded([9, 5, 7, 3])
    out = mmspec.speculative_generate(target, ModelDrafter(noisy_copy(target, 0.3), 6), ids, mask, temperature=0,
                                      max_new_tokens=20)
    assert 0 not in out.stats.nodes_per_step[:-1] and len(set(out.stats.new_tokens)) == 1
    assert torch.equal(out.sequences, _generate(target, ids, mask, 20))
