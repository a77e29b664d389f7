"""`process_logits` keeps exactly the token set transformers' own warpers keep (temperature,
then top-k, then top-p: the order `generate` builds them in), ties at the top-k / nucleus
boundary included, and gives the same probabilities."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from mmspec.sampling import SamplingConfig, process_logits


def _hf_probs(logits, temperature, top_k, top_p):
    procs = LogitsProcessorList()
    if temperature != 1.0:
        procs.append(TemperatureLogitsWarper(temperature))
    if top_k is not None:
        procs.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))
    return procs(None, logits.clone()).softmax(-1)


def test_top_p_ties_at_the_boundary_keep_the_same_ids_as_transformers():
    # Four equal logits, top_p = 0.5: the nucleus holds two of the four; transformers keeps
    # ids 2 and 3 (its ascending sort puts the higher ids of a tie last).
    logits = torch.zeros(1, 4, dtype=torch.float64)
    got = process_logits(logits, SamplingConfig(top_p=0.5))
    ref = _hf_probs(logits, 1.0, None, 0.5)
    assert torch.equal(got > 0, ref > 0), (got, ref)
    assert torch.allclose(got, ref, rtol=0, atol=1e-12)
    # The same with a clear winner plus a tied tail straddling the boundary.
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 1.0, -2.0]], dtype=torch.float64)
    for p in (0.7, 0.8, 0.9):
        got = process_logits(logits, SamplingConfig(top_p=p))
        ref = _hf_probs(logits, 1.0, None, p)
        assert torch.equal(got > 0, ref > 0), (p, got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_quantised_logits_many_ties_match_transformers(dtype):
    """Logits rounded to a coarse grid (many ties), every combination of settings: the kept
    set is identical row by row and the probabilities agree to rounding."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(256, 50, generator=g) * 2).round().to(dtype)  # ~9 distinct values per row
    checked = 0
    for temperature in (0.5, 1.0, 1.7):
        for top_k in (None, 1, 3, 7, 49, 50):
            for top_p in (None, 0.05, 0.3, 0.5, 0.9, 0.999):
                cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
                got = process_logits(logits, cfg)
                ref = _hf_probs(logits, temperature, top_k, top_p)
                bad = ((got > 0) != (ref > 0)).any(-1)
                assert not bad.any(), (cfg, bad.nonzero().flatten()[:5])
                assert torch.allclose(got, ref, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-12)
                checked += 1
    assert checked == 3 * 6 * 6
