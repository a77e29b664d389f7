"""One-step output laws of the relaxed rules where their documentation promises exactness,
computed analytically (no sampling): for a draft x ~ q the step emits x with probability
alpha(x), else a draw from residual(x), so its law is sum_x q(x) [alpha(x) d_x + (1 - alpha(x)) r_x]
(one-hot drafts: alpha(x) d_x + (1 - alpha(x)) r_x for the drafted x). Also GSD's cluster always
holding x, its distortion for sampled drafts, and LANTERN's neighbour cache across k."""

from __future__ import annotations

import pytest
import torch

from mmspec.acceptance import ExactAcceptance, GroupedAcceptance, LanternAcceptance

V = 16


def _cases(n=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        p = torch.rand(V, generator=g, dtype=torch.float64) ** 3
        p[torch.randperm(V, generator=g)[:6]] = 0.0  # top-k style zeros: neighbours that can lend nothing
        p /= p.sum()
        q = torch.rand(V, generator=g, dtype=torch.float64)
        yield p, q / q.sum()


def sampled_law(rule, p, q):
    xs, P, Q = torch.arange(V), p.expand(V, V), q.expand(V, V)
    a, r = rule.accept_probability(xs, P, Q), rule.residual(xs, P, Q)
    return q * a + (q * (1 - a)) @ r


def one_hot_laws(rule, p):
    xs, P = torch.arange(V), p.expand(V, V)
    a, r = rule.accept_probability(xs, P, None), rule.residual(xs, P, None)
    return torch.diag(a) + (1 - a)[:, None] * r  # row x: the law when x was drafted


CODEBOOK = torch.randn(V, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


@pytest.mark.parametrize("kwargs", [dict(delta=0.0), dict(lam=1.0), dict(delta=0.0, zero_neighbours="k")],
                         ids=["delta0", "lam1", "delta0-k"])
def test_lantern_limits_are_exact_for_sampled_and_one_hot_drafts(kwargs):
    """delta=0 / lam=1 lend nothing, so LANTERN is exact speculative sampling; a neighbour with
    p = 0 must not be consumed ("bound") and nothing is zeroed when x borrowed nothing ("k")."""
    rule = LanternAcceptance(CODEBOOK, k=5, **kwargs)
    for p, q in _cases():
        assert torch.allclose(sampled_law(rule, p, q), p, atol=1e-12)
        laws = one_hot_laws(rule, p)
        assert torch.allclose(laws[p > 0], p.expand(V, V)[p > 0], atol=1e-12)
    exact = ExactAcceptance()  # the check itself: the exact rule passes it, a relaxed LANTERN does not
    p, q = next(_cases())
    assert torch.allclose(sampled_law(exact, p, q), p, atol=1e-12)
    assert not torch.allclose(sampled_law(LanternAcceptance(CODEBOOK, k=5, delta=0.5), p, q), p, atol=1e-3)


def test_lantern_neighbour_cache_serves_a_larger_k_fully():
    cb = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    LanternAcceptance(cb, k=2, delta=0.5)  # fills the cache for this codebook with 2 neighbours
    big = LanternAcceptance(cb, k=10, delta=0.5)
    fresh = LanternAcceptance(cb.clone(), k=10, delta=0.5)  # another tensor: its own cache entry
    assert big.neighbours.shape == (64, 10) and torch.equal(big.neighbours, fresh.neighbours)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kwargs", [dict(prob_threshold=0.0), dict(distance_threshold=0.0)])
def test_gsd_with_a_zero_threshold_is_exact_since_x_is_always_in_its_cluster(kwargs, dtype):
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(32, 8, generator=g)
    p = torch.softmax(torch.randn(4, 32, generator=g), -1).to(dtype)
    q = torch.softmax(torch.randn(4, 32, generator=g), -1).to(dtype)
    x = torch.tensor([3, 7, 11, 20])
    rule, exact = GroupedAcceptance(emb, **kwargs), ExactAcceptance()
    for qq in (None, q):
        assert torch.allclose(rule.accept_probability(x, p, qq), exact.accept_probability(x, p, qq))


def test_gsd_distortion_of_sampled_drafts_is_the_mass_it_moves():
    """max(0, q(x) alpha - p(x)) per candidate (the module's formula); one-hot tests have q(x) = 1."""
    g = torch.Generator().manual_seed(1)
    M = 6
    emb = torch.randn(64, 4, generator=g) * 0.3  # look-alike tokens: non-trivial clusters
    p = torch.softmax(torch.randn(M, 64, generator=g) * 0.5, -1).double()
    q = torch.softmax(torch.randn(M, 64, generator=g) * 0.5, -1).double()
    x = torch.multinomial(q, 1, generator=g).squeeze(1)
    rule = GroupedAcceptance(emb, prob_threshold=1.0, distance_threshold=10.0)
    alpha = rule.accept_probability(x, p, q)
    qx, px = q.gather(1, x[:, None]).squeeze(1), p.gather(1, x[:, None]).squeeze(1)
    assert bool((alpha > px / qx + 1e-6).any())  # the clusters did relax acceptance
    assert torch.allclose(rule.distortion(x, p, q), (qx * alpha - px).clamp_min(0))
    res = rule.verify(x.view(M, 1), q.unsqueeze(1), torch.stack([p, p], 1), generator=torch.Generator().manual_seed(0))
    assert bool((res.distortion >= 0).all() and (res.distortion <= 1).all())
