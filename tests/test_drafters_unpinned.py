"""Drafter details that mutants of session 61 showed no test pinned: a tree of n nodes reports
depth <= n, a guided drafter keeps each remaining row's unconditional half when rows leave, its
unconditional prompts must have the conditional ones' shape, head configs refuse head counts
that do not divide and read a GQA target's sizes, NullDrafter needs a vocabulary, and the
foreign-output checks hold at their exact bounds."""

from __future__ import annotations

import pytest
import torch
import transformers

import mmspec
from mmspec.drafters import GuidedModelDrafter, ModelDrafter, NullDrafter
from mmspec.drafters.head_config import EagleHeadConfig
from mmspec.models.llamagen_spec import LlamaGenSpec, llamagen_target, null_class_uncond
from mmspec.types import AcceptanceResult, TargetOutput

from _llamagen_helpers import LABELS, NUM_CLASSES, tiny_gpt
from conftest import left_padded


def test_a_tree_of_n_nodes_reports_at_most_depth_n(target):
    ids, mask = left_padded([5, 8])
    tree = mmspec.TreeConfig(depth=5, top_k=1, num_nodes=3)
    out = mmspec.speculative_generate(target, ModelDrafter(target, tree=tree), ids, mask, temperature=0,
                                      max_new_tokens=13)
    assert out.stats.acceptance_rate_per_position == [1.0, 1.0, 1.0]  # a perfect drafter; no 4th position offered


def test_a_guided_drafter_keeps_each_rows_unconditional_half_when_rows_leave():
    gpt = tiny_gpt(0)
    target = llamagen_target(gpt, 4.0, cfg_schedule="constant", num_tokens=16)

    def drafter():
        return GuidedModelDrafter(LlamaGenSpec(gpt), 4.0, 3, make_uncond=null_class_uncond(NUM_CLASSES))

    ref = mmspec.speculative_generate(target, drafter(), LABELS.view(-1, 1), max_new_tokens=16, temperature=0)
    eos = int(ref.sequences[0, 4])  # a code row 0 emits early: rows leave the batch at different steps
    out = mmspec.speculative_generate(target, drafter(), LABELS.view(-1, 1), max_new_tokens=16, temperature=0,
                                      eos_token_id=eos)
    assert len(set(out.stats.new_tokens)) > 1
    assert out.stats.accepted_drafts == out.stats.drafted_nodes > 0  # the target's own GPT, guided alike


def test_a_guided_drafters_unconditional_prompts_must_match_the_conditional_shape():
    gpt = tiny_gpt(0)
    base = null_class_uncond(NUM_CLASSES)

    def longer(ids, mask, inputs):
        u, m, inputs = base(ids, mask, inputs)
        return torch.cat([u, u], 1), torch.cat([m, m], 1), inputs

    with pytest.raises(ValueError, match="uncond"):
        mmspec.speculative_generate(llamagen_target(gpt, 4.0, num_tokens=16),
                                    GuidedModelDrafter(LlamaGenSpec(gpt), 4.0, 3, make_uncond=longer),
                                    LABELS.view(-1, 1), max_new_tokens=16, temperature=0)


def test_head_configs_refuse_indivisible_heads_and_read_a_gqa_targets_sizes():
    with pytest.raises(ValueError, match="num_attention_heads by num_key_value_heads 3"):
        EagleHeadConfig(hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=3,
                        vocab_size=50)

    class Target:
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                          num_key_value_heads=2, vocab_size=50, num_hidden_layers=1)

    cfg = EagleHeadConfig.for_target(Target())
    assert (cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (96, 4, 2)


def test_null_drafter_needs_a_vocabulary():
    with pytest.raises(ValueError, match="vocab_size"):
        NullDrafter(0)


def test_foreign_output_checks_hold_at_their_exact_bounds(target, good_drafter):
    """One draft more than offered, and prefill logits of width 0: refused by name (each failed as
    a raw IndexError deep in the loop)."""
    from test_foreign_rule_target_checks import CustomGreedy, Wrapped, _run

    one_over = CustomGreedy(lambda r: AcceptanceResult(torch.full_like(r.num_accepted, 4), r.next_tokens))
    with pytest.raises(ValueError, match=r"num_accepted must be between 0 and 3"):
        _run(target, ModelDrafter(good_drafter, 3), acceptance=one_over)
    empty = Wrapped(target, lambda method, out: TargetOutput(logits=out.logits[:, :0]) if method == "prefill" else out)
    with pytest.raises(ValueError, match=r"Wrapped.prefill returned logits \(4, 0, 40\)"):
        _run(empty, ModelDrafter(good_drafter, 3))
