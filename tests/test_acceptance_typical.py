"""TypicalAcceptance (Medusa): entropy-dependent threshold, p as the residual."""

from __future__ import annotations

import math

import pytest
import torch

from _acceptance_helpers import P_MIN, chi_square_pvalue, dist, one_step
from mmspec.acceptance import TypicalAcceptance


def test_threshold_and_decision_follow_the_formula():
    p = torch.stack(
        [
            dist([0.97, 0.01, 0.01, 0.01]),  # peaked: threshold = epsilon
            dist([0.25, 0.25, 0.25, 0.25]),  # flat: threshold = alpha * exp(-ln 4) = alpha / 4
        ]
    )
    rule = TypicalAcceptance(epsilon=0.09, alpha=0.3)
    h0 = -sum(v * math.log(v) for v in p[0].tolist())
    assert abs(float(rule.threshold(p)[0]) - min(0.09, 0.3 * math.exp(-h0))) < 1e-12
    assert abs(float(rule.threshold(p)[1]) - 0.075) < 1e-12
    x = torch.tensor([1, 1])
    assert rule.accept_probability(x, p, None).tolist() == [0.0, 1.0]  # 0.01 < 0.09; 0.25 > 0.075
    # The draft distribution plays no role.
    assert rule.accept_probability(x, p, torch.full_like(p, 0.25)).tolist() == [0.0, 1.0]


def test_strict_inequality_and_zero_entropy():
    rule = TypicalAcceptance(epsilon=0.25, alpha=1.0)
    p = dist([0.25, 0.25, 0.25, 0.25])  # threshold min(0.25, exp(-ln 4)) = 0.25 == p(x)
    assert float(rule.accept_probability(torch.tensor([0]), p.unsqueeze(0), None)) == 0.0
    one_hot = dist([0.0, 1.0, 0.0])
    assert rule.accept_probability(torch.tensor([1, 0]), one_hot.expand(2, 3), None).tolist() == [1.0, 0.0]


def test_rejected_draft_is_replaced_by_a_target_sample():
    gen = torch.Generator().manual_seed(0)
    p = dist([0.5, 0.3, 0.15, 0.05])
    rule = TypicalAcceptance()
    x = torch.full((50_000,), 3)  # p(x) = 0.05 < threshold: always rejected
    _, res, first = one_step(rule, p, None, 50_000, gen, x=x)
    assert bool((res.num_accepted == 0).all())
    assert chi_square_pvalue(first, p) > P_MIN  # the residual is p itself (Medusa)
    assert float(res.distortion.abs().max()) == 0.0
    x = torch.zeros(10, dtype=torch.long)
    _, res, _ = one_step(rule, p, None, 10, gen, x=x)
    assert bool((res.num_accepted == 1).all())
    assert torch.allclose(res.distortion, torch.full((10,), 0.5, dtype=torch.float64))  # 1 - p(x)


@pytest.mark.parametrize("kwargs, word", [(dict(epsilon=-0.1), "epsilon"), (dict(epsilon=1.5), "epsilon"), (dict(alpha=-1.0), "alpha"),
                                          (dict(alpha=float("nan")), "alpha"), (dict(alpha=float("inf")), "alpha")])
def test_invalid_arguments(kwargs, word):
    with pytest.raises(ValueError, match=word):
        TypicalAcceptance(**kwargs)


@pytest.mark.parametrize("epsilon,alpha", [(0.09, 0.3), (1.0, 2.0)], ids=["medusa", "threshold-one"])
def test_at_temperature_zero_it_is_greedy_decoding_and_says_so(epsilon, alpha):
    """Greedy sampling makes p a one-hot: typical acceptance keeps only argmax drafts (or none),
    so the output equals plain greedy `generate` and the stats report the run lossless (they
    reported it lossy, the rule's general flag)."""
    import mmspec
    from mmspec.drafters import ModelDrafter

    from conftest import left_padded, noisy_copy, tiny_llama

    target = tiny_llama(layers=2, seed=0)
    drafter = noisy_copy(target, 0.3)
    ids, mask = left_padded([7, 4, 5])
    ref = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=0)
    rule = TypicalAcceptance(epsilon, alpha)
    out = mmspec.speculative_generate(target, ModelDrafter(drafter, 3), ids, mask, acceptance=rule, temperature=0,
                                      max_new_tokens=12, pad_token_id=0, eos_token_id=2)
    assert torch.equal(out.sequences, ref)
    assert out.stats.lossless and not rule.lossless  # the caller's rule object is not changed
    sampled = mmspec.speculative_generate(target, ModelDrafter(drafter, 3), ids, mask, acceptance=rule,
                                          temperature=1.0, max_new_tokens=4, generator=torch.Generator().manual_seed(0))
    assert not sampled.stats.lossless
