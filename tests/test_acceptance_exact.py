"""ExactAcceptance: the output of a speculative step is distributed like p."""

from __future__ import annotations

import torch

from _acceptance_helpers import P_MIN, chi_square_pvalue, dist, one_step, random_dist
from mmspec.acceptance import ExactAcceptance

N = 200_000


def test_exact_output_follows_target_with_sampled_draft():
    gen = torch.Generator().manual_seed(0)
    p = dist([0.30, 0.25, 0.2, 0.15, 0.0999, 0.0001])
    q = dist([0.05, 0.10, 0.40, 0.05, 0.25, 0.15])
    x, res, first = one_step(ExactAcceptance(), p, q, N, gen)
    assert chi_square_pvalue(first, p) > P_MIN
    # The acceptance rate is sum_y min(p, q).
    rate = (res.num_accepted == 1).double().mean().item()
    assert abs(rate - torch.minimum(p, q).sum().item()) < 0.005


def test_exact_output_follows_target_with_one_hot_draft():
    """Deterministic (one-hot) drafts, drawn from a skewed law: with uniformly drawn drafts a rule
    that resamples from p itself (the rejected draft not removed) or accepts with alpha^2 also
    emits exactly p, so the test could not see either; here both are rejected (power)."""
    from mmspec.sampling import normalize

    class ResidualIsP(ExactAcceptance):
        def residual(self, x, p, q):
            return normalize(p.clone(), p)

    class AcceptSquared(ExactAcceptance):
        def accept_probability(self, x, p, q):
            return super().accept_probability(x, p, q) ** 2

    p = random_dist(6, torch.Generator().manual_seed(1))
    skew = dist([0.5, 0.1, 0.1, 0.1, 0.1, 0.1])

    def emitted(rule):
        gen = torch.Generator().manual_seed(1)
        x = torch.multinomial(skew.expand(N // 2, 6), 1, replacement=True, generator=gen)[:, 0]
        return one_step(rule, p, None, N // 2, gen, x=x)[2]

    assert chi_square_pvalue(emitted(ExactAcceptance()), p) > P_MIN
    for broken in (ResidualIsP(), AcceptSquared()):
        assert chi_square_pvalue(emitted(broken), p) < P_MIN


def test_exact_bonus_token_follows_the_last_target_distribution():
    gen = torch.Generator().manual_seed(2)
    p0, p1 = random_dist(6, gen), random_dist(6, gen)
    _, res, _ = one_step(ExactAcceptance(), p0, p0, 50_000, gen, bonus=p1)
    assert bool((res.num_accepted == 1).all())  # p == q: always accepted
    assert chi_square_pvalue(res.next_tokens, p1) > P_MIN


def test_exact_p_equals_q_always_accepts_and_zero_residual_is_finite():
    gen = torch.Generator().manual_seed(3)
    p = random_dist(6, gen, zeros=2)
    rule = ExactAcceptance()
    x, res, _ = one_step(rule, p, p, 10_000, gen)
    assert bool((res.num_accepted == 1).all())
    assert torch.allclose(res.accept_probs, torch.ones_like(res.accept_probs))
    resid = rule.residual(x[:4], p.expand(4, 6), p.expand(4, 6))  # max(p - q, 0) == 0
    assert bool(torch.isfinite(resid).all()) and torch.allclose(resid.sum(-1), torch.ones(4, dtype=p.dtype))


def test_exact_never_emits_zero_probability_tokens():
    gen = torch.Generator().manual_seed(4)
    p = dist([0.5, 0.0, 0.5, 0.0, 0.0, 0.0])
    q = dist([0.1, 0.3, 0.1, 0.2, 0.2, 0.1])
    _, _, first = one_step(ExactAcceptance(), p, q, 20_000, gen)
    assert set(first.unique().tolist()) <= {0, 2}
    assert chi_square_pvalue(first, p) > P_MIN


def test_exact_float32_inputs_stay_finite_and_exact():
    gen = torch.Generator().manual_seed(5)
    p = random_dist(6, gen).float()
    q = random_dist(6, gen).float()
    _, res, first = one_step(ExactAcceptance(), p, q, 50_000, gen)
    assert res.accept_probs.dtype == torch.float32
    assert chi_square_pvalue(first, p.double()) > P_MIN


def test_greedy_fast_chain_verification_equals_the_generic_path():
    """GreedyAcceptance's own `verify_unchecked` gives what the generic chain path gives (accepted
    counts, next tokens, per-position acceptance), ties in the target's argmax included."""
    from mmspec.acceptance import GreedyAcceptance
    from mmspec.acceptance.base import ChainRule

    rule = GreedyAcceptance()
    g = torch.Generator().manual_seed(0)
    accepted, drafted = 0, 0
    for B, K, V, dtype in ((7, 4, 6, torch.float64), (5, 1, 3, torch.float32), (3, 6, 50, torch.float32)):
        p = torch.randint(0, 3, (B, K + 1, V), generator=g).to(dtype)  # small integers: many ties
        p[p.sum(-1) == 0] = 1.0
        top = p.argmax(-1)
        drafts = torch.where(torch.rand(B, K, generator=g) < 0.7, top[:, :K], torch.randint(0, V, (B, K), generator=g))
        fast = rule.verify_unchecked(drafts, None, p)
        ref = ChainRule.verify_unchecked(rule, drafts, None, p, generator=torch.Generator().manual_seed(1))
        assert torch.equal(fast.num_accepted, ref.num_accepted) and torch.equal(fast.next_tokens, ref.next_tokens)
        assert torch.equal(fast.accept_probs, ref.accept_probs) and fast.distortion is None
        accepted, drafted = accepted + int(fast.num_accepted.sum()), drafted + B * K
    assert 0 < accepted < drafted  # some drafts accepted, some rejected
