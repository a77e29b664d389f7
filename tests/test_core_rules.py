"""Acceptance rules from mmspec.acceptance used through the speculative loop, chains and trees."""

from __future__ import annotations

import pytest
import torch

import mmspec
from mmspec.acceptance import ExactAcceptance, LanternAcceptance, TypicalAcceptance
from mmspec.drafters import ModelDrafter

from conftest import VOCAB, left_padded

TREE = mmspec.TreeConfig(depth=3, top_k=2, num_nodes=6)


def generate(target, drafter_model, rule, tree=None, seed=11, temperature=1.0):
    ids, mask = left_padded([6, 4, 5, 3] * 4)
    return mmspec.speculative_generate(
        target, (ModelDrafter(drafter_model, tree=tree) if tree else ModelDrafter(drafter_model, 3)), ids, mask, acceptance=rule,
        temperature=temperature, max_new_tokens=12, generator=torch.Generator().manual_seed(seed),
    )


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
def test_lantern_with_zero_budget_reproduces_exact_token_for_token(target, good_drafter, tree):
    codebook = torch.randn(VOCAB, 8, generator=torch.Generator().manual_seed(0))
    exact = generate(target, good_drafter, ExactAcceptance(), tree)
    lantern0 = generate(target, good_drafter, LanternAcceptance(codebook, k=5, delta=0.0), tree)
    assert torch.equal(exact.sequences, lantern0.sequences)
    assert lantern0.stats.distortion_total == 0.0


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
def test_lossy_rules_report_distortion_and_accept_more(target, good_drafter, tree):
    codebook = torch.randn(VOCAB, 8, generator=torch.Generator().manual_seed(0))
    exact = generate(target, good_drafter, "exact", tree)
    lantern = generate(target, good_drafter, LanternAcceptance(codebook, k=10, delta=0.3), tree)
    typical = generate(target, good_drafter, TypicalAcceptance(epsilon=0.3, alpha=0.1), tree)
    assert exact.stats.distortion_total == 0.0
    for lossy in (lantern, typical):
        assert lossy.stats.distortion_total > 0.0
        assert lossy.stats.mean_distortion > 0.0
        assert lossy.stats.mean_accepted_length > exact.stats.mean_accepted_length
