"""MAR / CSpD details that mutants of session 61 showed no test pinned: the self-drafting sampler
writes every token when steps hold several tokens, counts the forwards each image took part in,
spends the documented residual budget; the two-model sampler counts bonus steps and reports
progress up to num_iter; ContinuousAcceptance keeps accepted drafts as samples and counts no
fallback for them."""

from __future__ import annotations

import torch

import mmspec.pipelines.cspd_self as cspd_self
from mmspec.acceptance import ContinuousAcceptance
from mmspec.pipelines.cspd import sample_mar
from mmspec.pipelines.cspd_self import sample_mar_self

from test_mar_cspd import tiny_mar
from test_mar_cspd_self import _ks_model


def test_self_drafting_writes_every_token_when_steps_hold_several():
    m = _ks_model()
    for num_iter in (9, 3):  # 9 tokens: 1 or 3 per step (a rejection mid-step keeps the step's accepted ones)
        tok, st = sample_mar_self(m, torch.full((200,), 2, dtype=torch.long), num_iter=num_iter, guidance_scale=1.5,
                                  num_draft_steps=2, generator=torch.Generator().manual_seed(11))
        assert 0.1 < st.acceptance_rate < 0.9  # rejections happen
        assert int((tok == 0).all(-1).sum()) == 0


def test_self_drafting_counts_the_forwards_each_image_took_part_in(monkeypatch):
    seen = []
    forward = cspd_self._Heads.forward

    def counting(self, tokens, known, seq_rows, need):
        seen.append(int(seq_rows.unique().numel()))
        return forward(self, tokens, known, seq_rows, need)

    monkeypatch.setattr(cspd_self._Heads, "forward", counting)
    _, st = sample_mar_self(_ks_model(), torch.full((8,), 2), num_iter=9, guidance_scale=1.5, num_draft_steps=2,
                            generator=torch.Generator().manual_seed(3))
    assert st.spec.target_calls == len(seen) and st.row_forwards == sum(seen) < 8 * len(seen)


def test_self_drafting_spends_the_documented_residual_budget(monkeypatch):
    """Every residual proposal fails (planted), one row: a rejected token draws residual_tries paths,
    four times as many after a round without success (at most max_residual_tries a round), and
    falls back once it has drawn max_residual_tries or more."""
    monkeypatch.setattr(cspd_self, "keep_proposal", lambda u, lq, lp: torch.zeros_like(u, dtype=torch.bool))
    for tries, most, per_fallback in ((1, 16, 1 + 4 + 4 + 4 + 4), (4, 4, 4)):
        _, st = sample_mar_self(_ks_model(), torch.tensor([2]), num_iter=9, guidance_scale=1.5, num_draft_steps=2,
                                residual_tries=tries, max_residual_tries=most,
                                generator=torch.Generator().manual_seed(3))
        assert st.fallbacks > 0 and st.residual_tries == per_fallback * st.fallbacks


def test_two_model_sampler_counts_bonus_steps_and_reports_progress_up_to_num_iter():
    """drafter == target, 8 steps, K=4, no prefill: round 1 drafts steps 0-3 and samples the bonus
    step 4; round 2 drafts steps 5-7, the last, so no bonus: one bonus step per row."""
    m, labels, seen = tiny_mar(), torch.tensor([0, 3, 4]), []
    _, st = sample_mar(m, labels, num_iter=8, drafter=m, num_draft_steps=4, prefill_fraction=0.0,
                       generator=torch.Generator().manual_seed(1), callback=seen.append)
    assert st.bonus_steps == len(labels)
    assert seen and max(seen) == 8 and seen == sorted(seen)


def test_continuous_verify_keeps_accepted_drafts_and_counts_no_fallback_for_them():
    B, K, D = 3, 2, 4
    x = torch.randn(B, K, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    m, s = torch.zeros(B, K, D, dtype=torch.float64), torch.ones(B, K, D, dtype=torch.float64)
    rule = ContinuousAcceptance(max_tries=4, tries_per_block=4)
    # identical Gaussians: every draft accepted, and the residual p - q = 0 (every proposal would fail)
    r = rule.verify(x, m, s, torch.zeros(B, K + 1, D, dtype=torch.float64),
                    torch.ones(B, K + 1, D, dtype=torch.float64), generator=torch.Generator().manual_seed(1))
    assert r.num_accepted.tolist() == [K] * B and torch.equal(r.samples, x)
    a = rule.accept_tokens(x, m, s, m, s, generator=torch.Generator().manual_seed(1))
    assert bool(a.accepted.all()) and a.fallbacks.tolist() == [0] * B and not bool(a.fell_back.any())
    assert torch.equal(a.samples, x)
