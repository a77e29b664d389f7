"""The shortened per-step paths (fewer tensor operations a step) compute what their definitions
say: LANTERN's borrowed mass against a loop over the neighbours, the capped ratio's edge cases,
inverse-CDF sampling against the textbook draw with the same uniforms, normalisation with rows
of no mass, the finiteness checks of the loop (host and tensor versions), shared index
tensors, and the Jacobi drafter's Gumbel coupling as the Gumbel-max of its stored noise."""

from __future__ import annotations

import math

import pytest
import torch

from mmspec.acceptance.exact import capped_ratio
from mmspec.acceptance.lantern import LanternAcceptance
from mmspec.drafters import JacobiDrafter
from mmspec.engine import _finite, _finite_host
from mmspec.sampling import SamplingConfig, cached_arange, normalize, probs_finite, sample_from
from mmspec.spec_target import chain_visibility
from mmspec.tree import chain_parents
from mmspec.types import TargetOutput


@pytest.mark.parametrize("mode", [{"delta": 0.05}, {"delta": 0.3}, {"lam": 2.0}])
def test_lantern_borrowed_mass_matches_a_loop_over_the_neighbours(mode):
    g = torch.Generator().manual_seed(0)
    V, k = 40, 7
    rule = LanternAcceptance(torch.randn(V, 3, generator=g), k=k, **mode)
    p = torch.rand(300, V, generator=g) ** 3
    p[::3, ::2] = 0.0  # zero-probability neighbours too
    p = p / p.sum(-1, keepdim=True)
    x = torch.randint(V, (300,), generator=g)
    c_J, J = rule.neighbour_mass(x, p)
    checked = 0
    for i in range(300):
        bound = mode["delta"] if "delta" in mode else (mode["lam"] - 1.0) * float(p[i, x[i]])
        running, want_J, want_c, near = 0.0, 0, 0.0, False
        for j in rule.neighbours[x[i]].tolist():
            running += float(p[i, j])
            near |= abs(running - bound) < 1e-5  # float32 rounding could decide this one: skipped
            if running > bound:
                break
            want_J, want_c = want_J + 1, running
        if near:
            continue
        checked += 1
        assert int(J[i]) == want_J, i
        assert float(c_J[i]) == pytest.approx(want_c, abs=1e-5), i
    assert checked > 250
    assert len(set(J.tolist())) >= 4  # several borrow counts exercised (0 to k in the three modes)


def test_capped_ratio_edges():
    num = torch.tensor([0.0, 0.0, 0.3, 0.2, 0.5, 1e-42])
    den = torch.tensor([0.0, 0.4, 0.0, 0.4, 0.25, 0.0])
    assert capped_ratio(num, den).tolist() == pytest.approx([0.0, 0.0, 1.0, 0.5, 1.0, 1.0])
    assert not torch.isnan(capped_ratio(num, den)).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sample_from_is_the_inverse_cdf_draw_of_the_same_uniforms(dtype):
    g = torch.Generator().manual_seed(1)
    w = torch.rand(500, 33, generator=g, dtype=dtype) ** 4
    w[::4, 20:] = 0.0  # trailing zero-weight tokens
    got = sample_from(w, torch.Generator().manual_seed(5))
    u = torch.rand(500, 1, generator=torch.Generator().manual_seed(5), dtype=dtype)
    cdf = w.cumsum(-1)
    want = [sum(1 for c in row if c <= uu * row[-1]) for row, uu in zip(cdf.tolist(), u.view(-1).tolist())]
    assert got.tolist() == want
    assert bool((w.gather(1, got.unsqueeze(1)) > 0).all())  # never a zero-weight token
    assert sample_from(w[:0], torch.Generator().manual_seed(5)).shape == (0,)  # no rows: no draw, no error


def test_normalize_divides_rows_with_mass_and_falls_back_on_the_others():
    w = torch.tensor([[1.0, 3.0, 0.0], [0.0, 0.0, 0.0], [2.0, 2.0, 4.0]])
    fallback = torch.full((3, 3), 7.0)
    out = normalize(w, fallback)
    assert out.tolist() == [[0.25, 0.75, 0.0], [7.0, 7.0, 7.0], [0.25, 0.25, 0.5]]
    assert normalize(w[[0, 2]], fallback[:2]).tolist() == [[0.25, 0.75, 0.0], [0.25, 0.25, 0.5]]


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf")])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_finiteness_checks_agree_and_catch_nan_and_inf(bad, temperature):
    sampling = SamplingConfig(temperature)
    logits = torch.randn(3, 5, 17, generator=torch.Generator().manual_seed(2))
    if bad is not None:
        logits[1, 2, 4] = bad
    from mmspec.sampling import process_logits

    probs = process_logits(logits, sampling)
    tensor_check, host_check = bool(_finite(logits, probs, sampling)), _finite_host(logits, probs, sampling)
    assert tensor_check == host_check == (bad is None)
    if temperature:  # the probabilities themselves
        assert bool(probs_finite(probs)) == (bad is None)
        assert math.isfinite(float(probs.sum())) == (bad is None)


def test_cached_index_tensors_are_right_and_shared():
    a = cached_arange(0, 12, 3)
    assert a.tolist() == [0, 3, 6, 9] and cached_arange(0, 12, 3) is a
    assert chain_parents(2, 4).tolist() == [[-1, 0, 1, 2]] * 2
    assert chain_parents(1, 1).tolist() == [[-1]]
    vis, depth = chain_visibility(2, 3, "cpu")
    assert vis.tolist() == [[[True, False, False], [True, True, False], [True, True, True]]] * 2
    assert depth.tolist() == [[0, 1, 2]] * 2 and chain_visibility(1, 3, torch.device("cpu"))[0].data_ptr() == vis.data_ptr()


def test_shared_tensors_are_intact_after_speculative_runs():
    """Batch-1 views of the shared tensors are writable (a size-1 batch dimension): a step that
    wrote into a path, parents, depth or visibility would corrupt every later step; none does."""
    from mmspec.bench.imagegen import DEFAULT_MODEL, load_pipeline

    pipe = load_pipeline(DEFAULT_MODEL)
    pipe.drafter = JacobiDrafter(6, "gumbel")
    for acceptance in ("exact", "lantern"):
        pipe([3], acceptance=acceptance, generator=torch.Generator().manual_seed(0), output_type="latent")
    for n in range(1, 8):
        assert cached_arange(0, n).tolist() == list(range(n))
        assert chain_parents(1, n).tolist() == [list(range(-1, n - 1))]
        vis, depth = chain_visibility(1, n, "cpu")
        assert torch.equal(vis[0], torch.ones(n, n, dtype=torch.bool).tril()) and depth[0].tolist() == list(range(n))


def test_gumbel_coupled_draft_is_the_gumbel_max_of_the_stored_noise():
    V, W = 11, 4
    drafter = JacobiDrafter(W, "gumbel", vocab_size=V)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 1, V, generator=gen)
    drafter.prefill(torch.zeros(2, 1, dtype=torch.long), None, TargetOutput(logits=logits), {}, 20)
    drafter.logits = torch.randn(2, W, V, generator=gen)  # as if recycled from a verify
    drafter.have_logits[:] = True
    sampling = SamplingConfig(1.0)
    draft = drafter.propose(torch.zeros(2, dtype=torch.long), sampling, gen)
    q = drafter.logits.softmax(-1)
    gumbel = -torch.log(-drafter.noise)  # the stored noise is log u: -log(-log u) ~ Gumbel(0, 1)
    assert torch.equal(draft.tokens, (q.log() + gumbel).argmax(-1))
    assert torch.allclose(draft.draft_probs, q)
    assert bool((drafter.noise < 0).all()) and bool(drafter.noise_valid.all())
