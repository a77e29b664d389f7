"""RelaxedContinuousAcceptance (CSpD's public-code inner temperature): tau = 1 is the exact
rule; tau > 1 keeps drafts at the rate of the widened Gaussians (checked against a numerical
integral), replaces rejected ones from the exact residual, and is measurably not the target's
law (so it is flagged lossy)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import integrate, stats

from mmspec.acceptance import (
    CONTINUOUS_RULES,
    ContinuousAcceptance,
    RelaxedContinuousAcceptance,
    get_continuous_rule,
)

P_MIN = 1e-3


def one_d(N, mq, sq, mp, sp, seed):
    gen = torch.Generator().manual_seed(seed)
    full = lambda v: torch.full((N, 1, 1), float(v), dtype=torch.float64)  # noqa: E731
    dm, ds, tm, ts = full(mq), full(sq), full(mp), full(sp)
    x = dm + ds * torch.randn(N, 1, 1, generator=gen, dtype=torch.float64)
    return x, dm, ds, tm, ts, gen


def accept_rate_integral(mq, sq, mp, sp, tau):
    """E_{x ~ q}[min(1, N(x; mp, tau sp) / N(x; mq, tau sq))], by quadrature."""
    def f(x):
        lr = stats.norm.logpdf(x, mp, tau * sp) - stats.norm.logpdf(x, mq, tau * sq)
        return stats.norm.pdf(x, mq, sq) * math.exp(min(0.0, lr))
    return integrate.quad(f, mq - 12 * sq, mq + 12 * sq, limit=200)[0]


def test_tau_one_is_the_exact_rule_draw_for_draw():
    x, dm, ds, tm, ts, _ = one_d(2000, 0.0, 1.0, 0.7, 0.8, seed=0)
    for method in ("accept_tokens", "verify"):
        extra = (1,) if method == "verify" else ()
        tm_, ts_ = (torch.cat([tm, tm], 1), torch.cat([ts, ts], 1)) if extra else (tm, ts)
        a = getattr(ContinuousAcceptance(), method)(x, dm, ds, tm_, ts_, generator=torch.Generator().manual_seed(5))
        b = getattr(RelaxedContinuousAcceptance(1.0), method)(x, dm, ds, tm_, ts_, generator=torch.Generator().manual_seed(5))
        assert torch.equal(a.accepted, b.accepted) and torch.equal(a.samples, b.samples)
        assert 0 < int(a.accepted.sum()) < 2000
    assert RelaxedContinuousAcceptance(1.0).lossless and not RelaxedContinuousAcceptance(2.0).lossless
    assert ContinuousAcceptance().lossless


@pytest.mark.parametrize("tau", [3.0, 42.0])
def test_accept_rate_matches_widened_gaussians(tau):
    N = 40_000
    mq, sq, mp, sp = 0.0, 1.0, 3.0, 1.0  # exact rule keeps 2 Phi(-1.5) = 13.4%
    x, dm, ds, tm, ts, gen = one_d(N, mq, sq, mp, sp, seed=1)
    res = RelaxedContinuousAcceptance(tau).accept_tokens(x, dm, ds, tm, ts, generator=gen)
    rate = float(res.accepted.double().mean())
    want = accept_rate_integral(mq, sq, mp, sp, tau)
    exact = accept_rate_integral(mq, sq, mp, sp, 1.0)
    tol = 5 * math.sqrt(want * (1 - want) / N)
    assert abs(rate - want) < tol
    assert abs(exact - 2 * stats.norm.cdf(-1.5)) < 1e-6  # the quadrature itself, against the closed form
    assert want - exact > 10 * tol  # power: the exact rule's rate is far outside the tolerance
    assert bool(torch.isfinite(res.accept_probs).all())


def test_output_law_is_the_relaxed_mixture_not_the_target():
    """Output = kept drafts q(x) min(1, r_tau(x)) + (1 - kept) * exact residual
    max(0, p - q) / (1 - overlap). KS against that mixture's CDF passes; against the target's
    own N(mp, sp) it fails (the rule is lossy, as flagged)."""
    N, tau = 40_000, 3.0
    mq, sq, mp, sp = 0.0, 1.0, 1.5, 0.7
    x, dm, ds, tm, ts, gen = one_d(N, mq, sq, mp, sp, seed=2)
    res = RelaxedContinuousAcceptance(tau, max_tries=128).accept_tokens(x, dm, ds, tm, ts, generator=gen)
    out = res.samples[:, 0, 0].numpy()
    assert int(res.fallbacks.sum()) == 0

    grid = np.linspace(-8, 8, 200_001)
    q, p = stats.norm.pdf(grid, mq, sq), stats.norm.pdf(grid, mp, sp)
    lr = stats.norm.logpdf(grid, mp, tau * sp) - stats.norm.logpdf(grid, mq, tau * sq)
    kept = q * np.exp(np.minimum(0.0, lr))
    resid = np.maximum(0.0, p - q)
    dens = kept + (1 - np.trapezoid(kept, grid)) * resid / np.trapezoid(resid, grid)
    cdf_vals = np.concatenate([[0.0], np.cumsum((dens[1:] + dens[:-1]) / 2 * np.diff(grid))])
    cdf = lambda v: np.interp(v, grid, cdf_vals / cdf_vals[-1])  # noqa: E731
    assert stats.kstest(out, cdf).pvalue > P_MIN
    assert stats.kstest(out, "norm", args=(mp, sp)).pvalue < 1e-6


def test_far_apart_tiny_stds_give_finite_results():
    """The testbed situation: means 16 stds apart in 8 dims. The exact rule keeps nothing; the
    relaxed one keeps some; nothing is NaN."""
    gen = torch.Generator().manual_seed(3)
    B, K, D, s = 4000, 1, 8, 0.0064
    mq = torch.randn(B, K, D, generator=gen, dtype=torch.float64)
    mp = mq + 16 * s * torch.sign(torch.randn(B, K, D, generator=gen, dtype=torch.float64))
    sd = torch.full_like(mq, s)
    x = mq + sd * torch.randn(B, K, D, generator=gen, dtype=torch.float64)
    exact = ContinuousAcceptance().accept_tokens(x, mq, sd, mp, sd, generator=gen)
    relaxed = RelaxedContinuousAcceptance(42.0).accept_tokens(x, mq, sd, mp, sd, generator=gen)
    assert int(exact.accepted.sum()) == 0
    # log r_tau = sum_d (2 z_d d_d - d_d^2) / (2 tau^2) with |d_d| = 16 stds, z ~ N(0, 1): a normal
    # with mean -D 256 / (2 tau^2) and variance D 256 / tau^4, almost always < 0, so the rate is
    # E exp(log r_tau) = exp(mean + var / 2)
    tau, d2 = 42.0, 16.0 ** 2
    want = math.exp(-D * d2 / (2 * tau**2) + D * d2 / tau**4 / 2)
    assert abs(float(relaxed.accepted.double().mean()) - want) < 5 * math.sqrt(want * (1 - want) / B)
    for r in (exact, relaxed):
        assert bool(torch.isfinite(r.samples).all() & torch.isfinite(r.accept_probs).all())


def test_names_and_bad_values():
    assert CONTINUOUS_RULES["continuous-relaxed"] is RelaxedContinuousAcceptance
    assert get_continuous_rule("continuous-relaxed").inner_temperature == 42.0
    assert get_continuous_rule("continuous-relaxed", inner_temperature=8).inner_temperature == 8.0
    for bad in (0.5, 0.0, -3.0, float("nan"), float("inf"), True, "42"):
        with pytest.raises(ValueError, match="inner_temperature"):
            RelaxedContinuousAcceptance(bad)
