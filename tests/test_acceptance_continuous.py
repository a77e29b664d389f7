"""ContinuousAcceptance (CSpD): acceptance from Gaussian final denoising steps, residual by
acceptance-rejection, explicit fallbacks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from mmspec.acceptance import ContinuousAcceptance, get_continuous_rule, get_rule

P_MIN = 1e-3


def gaussians(B, K, D, mq, sq, mp, sp, bonus=True, dtype=torch.float64):
    def full(v, k):
        return torch.as_tensor(v, dtype=dtype).expand(B, k, D).clone()

    Kt = K + 1 if bonus else K
    return full(mq, K), full(sq, K), full(mp, Kt), full(sp, Kt)


def draw(mean, std, gen):
    return mean + std * torch.randn(mean.shape, generator=gen, dtype=mean.dtype)


def overlap_1d(mq, sq, mp, sp):
    """integral of min(p, q) for two 1-D Gaussians (numerical, fine grid)."""
    lo, hi = min(mq - 10 * sq, mp - 10 * sp), max(mq + 10 * sq, mp + 10 * sp)
    y = np.linspace(lo, hi, 400_001)
    m = np.minimum(stats.norm.pdf(y, mq, sq), stats.norm.pdf(y, mp, sp))
    return float(np.trapezoid(m, y))


def test_identical_gaussians_accept_every_draft():
    gen = torch.Generator().manual_seed(0)
    B, K, D = 500, 4, 4
    mean = torch.randn(B, K + 1, D, generator=gen, dtype=torch.float64)
    std = torch.rand(B, K + 1, D, generator=gen, dtype=torch.float64) + 0.1
    x = draw(mean[:, :K], std[:, :K], gen)
    res = ContinuousAcceptance().verify(x, mean[:, :K], std[:, :K], mean, std, generator=gen)
    assert bool((res.num_accepted == K).all()) and bool((res.accept_probs == 1).all())
    assert int(res.fallbacks.sum()) == 0
    assert bool(torch.isfinite(res.next_samples).all())


def test_one_dimensional_output_follows_target():
    gen = torch.Generator().manual_seed(1)
    N = 40_000
    mq, sq, mp, sp = 0.0, 1.0, 1.0, 0.6
    dm, ds, tm, ts = gaussians(N, 1, 1, mq, sq, mp, sp)
    x = draw(dm, ds, gen)
    res = ContinuousAcceptance(max_tries=64).verify(x, dm, ds, tm, ts, generator=gen)
    first = torch.where((res.num_accepted == 1).unsqueeze(-1), x[:, 0], res.next_samples)[:, 0].numpy()
    assert stats.kstest(first, "norm", args=(mp, sp)).pvalue > P_MIN
    assert abs(first.mean() - mp) < 5 * sp / math.sqrt(N)
    assert abs(first.std() - sp) < 5 * sp / math.sqrt(2 * N)
    # The acceptance rate is the overlap integral of min(p, q).
    rate = (res.num_accepted == 1).double().mean().item()
    want = overlap_1d(mq, sq, mp, sp)
    assert abs(rate - want) < 5 * math.sqrt(want * (1 - want) / N)
    assert int(res.fallbacks.sum()) == int(res.fell_back.sum())
    assert int(res.fallbacks.sum()) < N * 1e-3  # residual mass ~0.4: 64 tries practically never fail


def test_four_dimensional_set_wise_tokens_follow_target():
    gen = torch.Generator().manual_seed(2)
    B, K, D = 2000, 8, 4
    mq = torch.tensor([0.0, 0.5, -1.0, 2.0], dtype=torch.float64)
    sq = torch.tensor([1.0, 0.5, 2.0, 1.0], dtype=torch.float64)
    mp = torch.tensor([0.3, 0.0, -0.5, 2.5], dtype=torch.float64)
    sp = torch.tensor([0.8, 0.7, 1.5, 1.2], dtype=torch.float64)
    dm, ds, tm, ts = (v.expand(B, K, D) for v in (mq, sq, mp, sp))
    x = draw(dm, ds, gen)
    res = ContinuousAcceptance().accept_tokens(x, dm, ds, tm, ts, generator=gen)
    out = res.samples.reshape(-1, D).numpy()
    n = out.shape[0]
    assert 0.05 < res.accepted.double().mean().item() < 0.95  # both branches exercised
    for d in range(D):
        assert stats.kstest(out[:, d], "norm", args=(float(mp[d]), float(sp[d]))).pvalue > P_MIN
        assert abs(out[:, d].mean() - float(mp[d])) < 5 * float(sp[d]) / math.sqrt(n)
    # Dimensions stay independent, as under the target (diagonal Gaussian).
    corr = np.corrcoef(out.T)
    assert np.abs(corr - np.eye(D)).max() < 5 / math.sqrt(n)
    assert int(res.fallbacks.sum()) == int(res.fell_back.sum())


def test_chain_bonus_and_prefix():
    gen = torch.Generator().manual_seed(3)
    B, K, D = 4000, 3, 2
    dm, ds, tm, ts = gaussians(B, K, D, 0.0, 1.0, 0.0, 1.0)
    tm[:, K] = 3.0  # bonus position has its own Gaussian
    x = draw(dm, ds, gen)
    res = ContinuousAcceptance().verify(x, dm, ds, tm, ts, generator=gen)
    assert bool((res.num_accepted == K).all())
    ns = res.next_samples.numpy()
    assert stats.kstest(ns[:, 0], "norm", args=(3.0, 1.0)).pvalue > P_MIN


def test_fallback_is_explicit_and_counted():
    gen = torch.Generator().manual_seed(4)
    B, K, D = 2000, 1, 1
    # Nearly identical Gaussians: the residual holds ~1% of the mass, so a single try
    # almost always fails and the fallback is used.
    dm, ds, tm, ts = gaussians(B, K, D, 0.0, 1.0, 0.02, 1.0)
    x = torch.full_like(dm, -4.0)  # drafts in q's tail where p/q = 0.92: some rejections
    res = ContinuousAcceptance(max_tries=1).verify(x, dm, ds, tm, ts, generator=gen)
    rejected = res.num_accepted == 0
    assert int(rejected.sum()) > 0
    assert int(res.fallbacks.sum()) > 0
    assert bool((res.fallbacks.bool() <= rejected).all())  # only rejected rows can fall back
    assert torch.equal(res.fallbacks.bool(), res.fell_back[:, 0])
    assert bool(torch.isfinite(res.next_samples).all())
    assert bool((res.next_samples[res.fallbacks.bool()] != 0).all())  # never a silent zero token
    # With many tries the fallback rate drops.
    res_many = ContinuousAcceptance(max_tries=128, tries_per_block=64).verify(x, dm, ds, tm, ts, generator=gen)
    assert int(res_many.fallbacks.sum()) < int(res.fallbacks.sum())


def test_trajectory_term_moves_acceptance_monotonically():
    gen = torch.Generator().manual_seed(5)
    B, K, D = 1000, 2, 3
    dm, ds, tm, ts = gaussians(B, K, D, 0.0, 1.0, 0.5, 0.8)
    x = draw(dm, ds, gen)
    rule = ContinuousAcceptance(max_tries=4)
    base = rule.verify(x, dm, ds, tm, ts, generator=torch.Generator().manual_seed(9))
    zeros = torch.zeros(B, K, D, dtype=torch.float64)
    same = rule.verify(x, dm, ds, tm, ts, draft_logstd_sum=zeros, target_logstd_sum=zeros, generator=torch.Generator().manual_seed(9))
    assert torch.equal(base.num_accepted, same.num_accepted)
    # Larger draft stds along the trajectory (S_q > S_p) raise r by exp(sum(S_q - S_p)).
    up = rule.verify(x, dm, ds, tm, ts, draft_logstd_sum=zeros + 0.1, target_logstd_sum=zeros, generator=torch.Generator().manual_seed(9))
    assert bool((up.accept_probs >= base.accept_probs).all())
    ratio = up.accept_probs / base.accept_probs
    unclipped = up.accept_probs < 1
    assert torch.allclose(ratio[unclipped], torch.full_like(ratio[unclipped], math.exp(0.3)))
    summed = rule.verify(x, dm, ds, tm, ts, draft_logstd_sum=zeros[..., 0] + 0.3, target_logstd_sum=zeros[..., 0], generator=torch.Generator().manual_seed(9))
    assert torch.allclose(summed.accept_probs, up.accept_probs)


def test_float32_and_k_zero():
    gen = torch.Generator().manual_seed(6)
    dm, ds, tm, ts = gaussians(5, 0, 2, 0.0, 1.0, 1.0, 1.0, dtype=torch.float32)
    res = ContinuousAcceptance().verify(torch.zeros(5, 0, 2), dm, ds, tm, ts, generator=gen)
    assert bool((res.num_accepted == 0).all()) and tuple(res.next_samples.shape) == (5, 2)
    dm, ds, tm, ts = gaussians(5, 2, 2, 0.0, 1.0, 1.0, 2.0, dtype=torch.float32)
    res = ContinuousAcceptance().verify(draw(dm, ds, gen), dm, ds, tm, ts, generator=gen)
    assert res.accept_probs.dtype == torch.float32 and bool(torch.isfinite(res.next_samples).all())


def test_invalid_inputs_name_the_argument():
    dm, ds, tm, ts = gaussians(2, 3, 4, 0.0, 1.0, 0.0, 1.0)
    x = torch.zeros(2, 3, 4, dtype=torch.float64)
    rule = ContinuousAcceptance()
    for bad in (dict(max_tries=True), dict(tries_per_block=True)):  # True ran as 1
        with pytest.raises(ValueError, match="must be an int >= 1, got True"):
            ContinuousAcceptance(**bad)
    with pytest.raises(ValueError, match="draft_std"):
        rule.verify(x, dm, -ds, tm, ts)
    with pytest.raises(ValueError, match="target_std"):
        rule.verify(x, dm, ds, tm, ts * 0)
    with pytest.raises(ValueError, match="target_mean"):
        rule.verify(x, dm, ds, tm[:, :3], ts)
    with pytest.raises(ValueError, match="draft_samples"):
        rule.verify(x[0], dm, ds, tm, ts)
    with pytest.raises(ValueError, match="logstd"):
        rule.verify(x, dm, ds, tm, ts, draft_logstd_sum=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="draft_mean"):
        rule.verify(x, dm.clone().fill_(float("nan")), ds, tm, ts)
    with pytest.raises(ValueError, match="max_tries"):
        ContinuousAcceptance(max_tries=0)
    assert isinstance(get_continuous_rule("continuous", max_tries=8), ContinuousAcceptance)
    with pytest.raises(ValueError, match="MAR pipeline"):
        get_rule("continuous")  # not a discrete rule: its own registry


def test_trajectory_terms_of_different_allowed_shapes_are_each_summed_over_d():
    """[B, K, D] beside [B, K] was subtracted by broadcasting: with K == D a wrong offset and
    acceptance probability (0.008 for 0.86), otherwise a raw RuntimeError."""
    from mmspec.acceptance import ContinuousAcceptance

    g = torch.Generator().manual_seed(0)
    for B, K, D in ((1, 3, 3), (2, 3, 4)):
        x = torch.zeros(B, K, D, dtype=torch.float64)
        s = torch.ones(B, K, D, dtype=torch.float64)
        Sq = torch.rand(B, K, D, generator=g, dtype=torch.float64)
        Sp = 2.0 + torch.rand(B, K, generator=g, dtype=torch.float64)
        r = ContinuousAcceptance().accept_tokens(x, x, s, x, s, draft_logstd_sum=Sq, target_logstd_sum=Sp,
                                                 generator=torch.Generator().manual_seed(1))
        assert torch.allclose(r.accept_probs, torch.exp((Sq.sum(-1) - Sp).clamp(max=0)))  # p == q: min(1, e^offset)


def test_the_log_ratio_never_judges_a_nan():
    """Both float32 Gaussian densities underflowed to -inf for finite inputs, and log r = NaN
    rejected the draft (counted as a fallback) even where p == q; in float64 it is accepted.
    What still underflows in float64 is refused by name instead of judged."""
    from mmspec.acceptance import ContinuousAcceptance

    t = lambda v, dtype: torch.full((1, 1, 1), v, dtype=dtype)  # noqa: E731
    for dtype in (torch.float32, torch.float64):
        r = ContinuousAcceptance().accept_tokens(t(0.0, dtype), t(1e20, dtype), t(1.0, dtype), t(1e20, dtype),
                                                 t(1.0, dtype), generator=torch.Generator().manual_seed(0))
        assert r.accept_probs.item() == 1.0 and bool(r.accepted.all()), dtype
    with pytest.raises(ValueError, match="underflowed even in float64"):
        ContinuousAcceptance().accept_tokens(t(0.0, torch.float64), t(1e-100, torch.float64), t(1e-300, torch.float64),
                                             t(1e-100, torch.float64), t(1e-300, torch.float64))
