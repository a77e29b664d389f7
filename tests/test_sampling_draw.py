"""`sample_from` (inverse-CDF sampling) draws tokens with exactly the given weights: a
chi-square goodness of fit per row of a batch, zero-weight tokens never drawn (also the last
tokens of a row, where rounding of the uniform could run past the mass), unnormalised
weights, rows that are not a distribution sampled uniformly, and a planted bug (an off-by-one
in the search) caught by the same test."""

from __future__ import annotations

import torch

from mmspec.sampling import sample_from

from _acceptance_helpers import chi_square_pvalue

N = 40_000  # draws per row: expected counts >= 5 for every token below, 4 rows at once


def _weights(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.rand(4, 12, generator=g, dtype=dtype)
    w[0, 3] = 0.0
    w[1, -3:] = 0.0  # trailing zeros: the last positive token must absorb the top of the range
    w[2] *= 7.5  # unnormalised
    w[3, 0] = 0.0
    return w


def _draw(w, sampler=sample_from):
    g = torch.Generator().manual_seed(1)
    rows = w.repeat_interleave(N, 0)
    return sampler(rows, g).view(w.shape[0], N)


def test_sample_from_matches_the_weights_row_by_row():
    for dtype in (torch.float32, torch.float64):
        w = _weights(dtype)
        tokens = _draw(w)
        for r in range(w.shape[0]):
            p = w[r] / w[r].sum()
            assert bool((p[tokens[r]] > 0).all()), f"row {r}: a zero-weight token was drawn ({dtype})"
            pval = chi_square_pvalue(tokens[r], p.double())
            assert pval > 1e-4, f"row {r} ({dtype}): chi-square p={pval:.2e}"


def test_the_chi_square_check_catches_an_off_by_one_sampler():
    # Power check: the same test on a sampler whose search is shifted by one token fails.
    def shifted(probs, generator):
        return (sample_from(probs, generator) + 1).clamp_max(probs.shape[-1] - 1)

    w = _weights(torch.float64)
    tokens = _draw(w, shifted)
    assert min(chi_square_pvalue(tokens[r], (w[r] / w[r].sum())) for r in range(4)) < 1e-4


def test_never_past_the_mass_and_bad_rows_are_uniform():
    g = torch.Generator().manual_seed(2)
    # One positive token followed by zeros: every draw must be that token, even when the
    # uniform lands at the very top of the range.
    w = torch.zeros(2000, 7)
    w[:, 2] = 1e-30
    assert bool((sample_from(w, g) == 2).all())
    # NaN / negative / all-zero rows do not abort the step: they are drawn uniformly (the loop
    # refuses such rows itself); each covers all V tokens over many draws.
    bad = torch.tensor([[float("nan"), 1.0, 1.0], [-1.0, 2.0, 0.0], [0.0, 0.0, 0.0]])
    draws = sample_from(bad.repeat_interleave(3000, 0), g).view(3, 3000)
    for r in range(3):
        counts = torch.bincount(draws[r], minlength=3)
        assert bool((counts > 800).all()), (r, counts)
    # An inf weight, and finite float32 weights whose running sum overflows to inf: uniform too.
    bad32 = torch.tensor([[float("inf"), 1.0, 1.0], [3e38, 3e38, 1.0]])
    draws = sample_from(bad32.repeat_interleave(3000, 0), g).view(2, 3000)
    for r in range(2):
        counts = torch.bincount(draws[r], minlength=3)
        assert bool((counts > 800).all()), (r, counts)
