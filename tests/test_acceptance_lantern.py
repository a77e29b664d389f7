"""LanternAcceptance (LANTERN / LANTERN++): neighbours, exact limits, monotonicity, bounds."""

from __future__ import annotations

import pytest
import torch

import mmspec.acceptance.lantern as lantern_mod
from _acceptance_helpers import P_MIN, chi_square_pvalue, one_step, random_dist
from mmspec.acceptance import ExactAcceptance, LanternAcceptance

V, D = 6, 3


def codebook(V=V, D=D, seed=0):
    return torch.randn(V, D, generator=torch.Generator().manual_seed(seed))


def brute_neighbours(cb, normalize=True):
    e = torch.nn.functional.normalize(cb.float(), dim=-1) if normalize else cb.float()
    d = torch.cdist(e, e)
    d.fill_diagonal_(float("inf"))
    return d.argsort(-1)[:, : cb.shape[0] - 1]


def test_neighbours_match_brute_force_and_exclude_self(monkeypatch):
    cb = codebook(40, 5, seed=1)
    rule = LanternAcceptance(cb, k=39, delta=0.1)
    assert rule.neighbours.dtype == torch.int16 and tuple(rule.neighbours.shape) == (40, 39)
    assert torch.equal(rule.neighbours.long(), brute_neighbours(cb))
    assert not bool((rule.neighbours.long() == torch.arange(40).unsqueeze(1)).any())
    raw = LanternAcceptance(cb, k=5, delta=0.1, normalize=False)
    assert torch.equal(raw.neighbours.long(), brute_neighbours(cb, normalize=False)[:, :5])
    # Row chunking (forced to 3 rows at a time on a fresh codebook) gives the same lists.
    monkeypatch.setattr(lantern_mod, "_CHUNK_ELEMENTS", 3 * 40)
    cb2 = cb.clone()
    assert torch.equal(lantern_mod.nearest_neighbours(cb2, 39).long(), brute_neighbours(cb2))


def test_neighbours_of_codes_sharing_a_large_offset_keep_their_order():
    """|a|^2 + |b|^2 - 2 a.b in float32 cancelled when every code sat near one far point (a
    spread 1000x smaller than the offset: 44-46% of nearest neighbours wrong; normalised
    codebooks clustered around one direction the same way). Centring first keeps the order."""
    gen = torch.Generator().manual_seed(3)
    offset = 100.0 * torch.randn(1, 8, generator=gen)
    cb = offset + 0.1 * torch.randn(64, 8, generator=gen)
    exact = torch.cdist(cb.double(), cb.double())
    exact.fill_diagonal_(float("inf"))
    nearest = exact.argmin(-1)
    raw = lantern_mod.nearest_neighbours(cb, 3, normalize_codebook=False).long()
    assert torch.equal(raw[:, 0], nearest)
    unit = torch.nn.functional.normalize(cb.double(), dim=-1)
    exact = torch.cdist(unit, unit)
    exact.fill_diagonal_(float("inf"))
    agree = (lantern_mod.nearest_neighbours(cb.clone(), 1).long()[:, 0] == exact.argmin(-1)).float().mean()
    assert agree >= 0.95  # (float32 on unit vectors 1e-3 apart: a rare near-tie may still swap)


def test_neighbours_are_cached_per_codebook():
    cb = codebook(30, 4, seed=2)
    a = LanternAcceptance(cb, k=20, delta=0.1)
    b = LanternAcceptance(cb, k=10, lam=5.0)
    assert b.neighbours.data_ptr() == a.neighbours.data_ptr()  # a slice of the cached lists
    cb.add_(1.0)  # in-place change bumps the version: recomputed
    c = LanternAcceptance(cb, k=10, delta=0.1)
    assert torch.equal(c.neighbours.long(), brute_neighbours(cb)[:, :10])


@pytest.mark.parametrize(
    "kwargs", [dict(k=5, delta=0.0), dict(k=0, delta=0.5), dict(k=5, lam=1.0)], ids=["delta0", "k0", "lam1"]
)
def test_exact_limits_follow_target(kwargs):
    gen = torch.Generator().manual_seed(10)
    p = random_dist(V, gen, zeros=1)
    q = random_dist(V, gen)
    rule = LanternAcceptance(codebook(), **kwargs)
    x, res, first = one_step(rule, p, q, 200_000, gen)
    assert chi_square_pvalue(first, p) > P_MIN
    exact_alpha = ExactAcceptance().accept_probability(x, p.expand(x.numel(), V), q.expand(x.numel(), V))
    assert torch.allclose(res.accept_probs[:, 0], exact_alpha)
    assert float(res.distortion.max()) == 0.0


def test_one_hot_drafts_follow_the_relaxed_target():
    """Deterministic draft x: the step's output is exactly p~ (x holds p(x) + c_J, its lent
    neighbours 0), at total variation c_J from p."""
    gen = torch.Generator().manual_seed(11)
    p = random_dist(V, gen)
    rule = LanternAcceptance(codebook(), k=3, delta=0.3)
    x0 = torch.tensor([2])
    c_J, J = rule.neighbour_mass(x0, p.unsqueeze(0))
    assert int(J) >= 1
    p_tilde = p.clone()
    p_tilde[rule.neighbours[2, : int(J)].long()] = 0.0
    p_tilde[2] = p[2] + c_J[0]
    assert abs(float(p_tilde.sum()) - 1.0) < 1e-12
    _, res, first = one_step(rule, p, None, 100_000, gen, x=x0.expand(100_000))
    assert chi_square_pvalue(first, p_tilde) > P_MIN
    assert torch.allclose(res.distortion, c_J.expand(100_000))
    assert abs(0.5 * (p_tilde - p).abs().sum().item() - c_J.item()) < 1e-12


def test_acceptance_non_decreasing_in_delta_and_k():
    gen = torch.Generator().manual_seed(12)
    Vb, M = 64, 512
    cb = codebook(Vb, 4, seed=3)
    p = torch.softmax(torch.randn(M, Vb, generator=gen, dtype=torch.float64), -1)
    q = torch.softmax(torch.randn(M, Vb, generator=gen, dtype=torch.float64), -1)
    x = torch.multinomial(q, 1, generator=gen).squeeze(-1)
    for qq in (q, None):
        prev = None
        for delta in (0.0, 0.01, 0.05, 0.1, 0.3, 1.0):
            a = LanternAcceptance(cb, k=20, delta=delta).accept_probability(x, p, qq)
            assert prev is None or bool((a >= prev - 1e-12).all())
            prev = a
        prev = None
        for k in (0, 1, 5, 20, 63):
            a = LanternAcceptance(cb, k=k, delta=0.1).accept_probability(x, p, qq)
            assert prev is None or bool((a >= prev - 1e-12).all())
            prev = a
        prev = None
        for lam in (1.0, 2.0, 5.0, 20.0):
            a = LanternAcceptance(cb, k=20, lam=lam).accept_probability(x, p, qq)
            assert prev is None or bool((a >= prev - 1e-12).all())
            prev = a


def test_added_mass_never_exceeds_the_bound():
    gen = torch.Generator().manual_seed(13)
    Vb, M = 64, 1024
    cb = codebook(Vb, 4, seed=4)
    p = torch.softmax(2 * torch.randn(M, Vb, generator=gen), -1)  # float32
    x = torch.randint(0, Vb, (M,), generator=gen)
    px = p.gather(-1, x.unsqueeze(-1)).squeeze(-1)
    for delta in (0.0, 0.05, 0.1, 0.5):
        rule = LanternAcceptance(cb, k=30, delta=delta)
        c_J, J = rule.neighbour_mass(x, p)
        assert bool((c_J <= delta).all()) and bool((c_J >= 0).all())
        # J is maximal: one more neighbour would exceed the bound.
        nxt = p.gather(-1, rule.neighbours[x].long()).cumsum(-1)
        more = torch.where(J < 30, nxt.gather(-1, J.clamp(max=29).unsqueeze(-1)).squeeze(-1), torch.full_like(c_J, 9.0))
        assert bool((more > delta).all())
    for lam in (1.0, 2.0, 5.0, 10.0):
        rule = LanternAcceptance(cb, k=30, lam=lam)
        assert bool((rule.relaxed_probability(x, p) <= lam * px * (1 + 1e-6)).all())
        assert bool((rule.distortion(x, p, None) <= (lam - 1) * px * (1 + 1e-6)).all())


def test_sampled_draft_residual_zeroes_lent_neighbours_in_q():
    p = torch.tensor([[0.3, 0.3, 0.2, 0.2]], dtype=torch.float64)
    q = torch.tensor([[0.1, 0.6, 0.2, 0.1]], dtype=torch.float64)
    cb = torch.tensor([[0.0, 1.0], [0.1, 1.0], [1.0, 0.0], [1.0, 0.1]])  # 0<->1, 2<->3 are neighbours
    rule = LanternAcceptance(cb, k=1, delta=0.35)
    x = torch.tensor([0])
    assert torch.equal(rule.neighbours[0].long(), torch.tensor([1]))
    assert torch.allclose(rule.accept_probability(x, p, q), torch.ones(1, dtype=torch.float64))  # (0.3+0.3)/0.1
    resid = rule.residual(x, p, q)
    q_relaxed = torch.tensor([0.25, 0.0, 0.5, 0.25], dtype=torch.float64)
    expected = (p[0] - q_relaxed).clamp_min(0)
    assert torch.allclose(resid[0], expected / expected.sum())
    # "k" mode (public code) zeroes the same neighbour here; one-hot residual zeroes x and it.
    resid_det = rule.residual(x, p, None)
    assert torch.allclose(resid_det[0], torch.tensor([0.0, 0.0, 0.5, 0.5], dtype=torch.float64))
    assert torch.allclose(LanternAcceptance(cb, k=1, delta=0.35, zero_neighbours="k").residual(x, p, None), resid_det)


def test_residual_with_nothing_left_is_the_target():
    """Uniform before session 55, which could draw a token the target gives 0 (see below)."""
    cb = codebook(3, 2)
    rule = LanternAcceptance(cb, k=2, delta=1.0)
    p = torch.tensor([[0.5, 0.25, 0.25]])
    resid = rule.residual(torch.tensor([0]), p, None)  # x and both neighbours zeroed
    assert torch.allclose(resid, p)


def test_measured_acceptance_rates_increase_with_relaxation():
    """Sample problem: flat p over 256 codes with 8-D clustered latents, sampled drafts."""
    gen = torch.Generator().manual_seed(14)
    Vb, M = 256, 4000
    centers = torch.randn(32, 8, generator=gen)
    cb = centers.repeat_interleave(8, 0) + 0.1 * torch.randn(Vb, 8, generator=gen)
    p = torch.softmax(0.5 * torch.randn(M, Vb, generator=gen), -1)
    q = torch.softmax(0.5 * torch.randn(M, Vb, generator=gen), -1)
    x = torch.multinomial(q, 1, generator=gen).squeeze(-1)
    exact = ExactAcceptance().accept_probability(x, p, q).mean().item()
    lan = LanternAcceptance(cb, k=50, delta=0.1).accept_probability(x, p, q).mean().item()
    lpp = LanternAcceptance(cb, k=10, lam=5.0).accept_probability(x, p, q).mean().item()
    assert exact < lan and exact < lpp


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(k=3, delta=-0.1), "delta"),
        (dict(k=6, delta=0.1), "k"),
        (dict(k=-1, delta=0.1), "k"),
        (dict(k=3, lam=0.5), "lam"),
        (dict(k=3, delta=0.1, lam=2.0), "delta"),
        (dict(k=3, zero_neighbours="all"), "zero_neighbours"),
        (dict(k=3, lam=float("nan")), "lam"),  # NaN passed `lam < 1`
        (dict(k=3, lam=float("inf")), "lam"),
        (dict(k=True), "k"),
    ],
)
def test_invalid_arguments_name_the_argument(kwargs, word):
    with pytest.raises(ValueError, match=word):
        LanternAcceptance(codebook(), **kwargs)


def test_codebook_must_be_2d():
    with pytest.raises(ValueError, match="codebook"):
        LanternAcceptance(torch.randn(6), k=1)
    bad = codebook().clone()
    bad[1, 0] = float("nan")  # NaN distances made the neighbour lists arbitrary
    with pytest.raises(ValueError, match="codebook holds NaN"):
        LanternAcceptance(bad, k=1)
    with pytest.raises(TypeError, match="normalize must be True or False"):  # "no" normalised
        LanternAcceptance(codebook(), k=1, normalize="no")
    rule = LanternAcceptance(codebook(), k=2)
    with pytest.raises(ValueError, match="codebook"):
        rule.accept_probability(torch.tensor([0]), torch.full((1, 7), 1 / 7), None)


def test_neighbour_lists_never_come_from_a_freed_codebook_at_the_same_address():
    """The cache was keyed by address, shape, stride and version but did not keep the codebook
    alive: a new codebook of the same shape allocated where a freed one lay got the old lists
    (16 of 20 trials). Each codebook's lists must equal its own brute-force neighbours."""
    from mmspec.acceptance.lantern import nearest_neighbours

    for trial in range(20):
        g = torch.Generator().manual_seed(trial)
        cb = torch.randn(48, 5, generator=g)
        got = nearest_neighbours(cb, 4)
        emb = torch.nn.functional.normalize(cb, dim=-1)
        d2 = torch.cdist(emb, emb) ** 2
        d2.fill_diagonal_(float("inf"))
        assert torch.equal(got.long(), d2.topk(4, largest=False).indices), trial
        del cb, got  # frees the codebook's memory for the next trial's allocation


def test_an_empty_residual_falls_back_to_the_target_never_to_tokens_it_cut():
    """When x and its lent neighbours hold all of p, alpha = 1 can round to 0.99999994 in float32;
    on that rare rejection the residual was uniform, drawing tokens top-k had cut (p = 0)."""
    torch.manual_seed(0)
    V = 16
    rule = LanternAcceptance(torch.randn(V, 4), k=V - 1, delta=1.0)
    reached = 0
    for _ in range(2000):
        logits = torch.randn(V) * 2
        logits[torch.randperm(V)[:8]] = -float("inf")  # as top-k leaves it
        p = torch.softmax(logits, -1).unsqueeze(0)
        x = p.argmax(-1)
        if rule.accept_probability(x, p, None).item() < 1:
            reached += 1
            assert rule.residual(x, p, None)[0][p[0] == 0].sum().item() == 0
    assert reached > 100  # the rounding case is common enough here for the check to bite


def test_half_precision_weights_are_sampled_and_normalised_in_float32():
    """A float16 / bfloat16 running sum skipped whole tokens (bfloat16, uniform over 4096: 3328
    never drawn); `normalize`'s zero-mass floor was ~1 at V = 1024 in float16, so every row fell back."""
    from mmspec.sampling import normalize, sample_from

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        tokens = sample_from(torch.full((40000, 256), 1.0 / 256, dtype=dtype), g)
        counts = torch.bincount(tokens, minlength=256).float()
        assert counts.min() > 100 and counts.max() < 220  # expected 156 each; sd ~12.5
        w = torch.zeros(1, 1024, dtype=dtype)
        w[0, 1], w[0, 2] = 1e-3, 2e-3
        out = normalize(w, torch.full_like(w, 1.0 / 1024))
        assert abs(out[0, 1].item() - 1 / 3) < 1e-3 and abs(out[0, 2].item() - 2 / 3) < 1e-3
