"""The invariant JacobiDrafter's exactness rests on (drafters/jacobi.py, module docstring): after
any commit, each new draft is distributed q given everything the verifier has seen, so a coupled
draft may reuse a slot's previous draft or noise only where that slot's position did not move.
Driven at the drafter API with every target distribution uniform over V: a new draft must equal
the draft just rejected, or another slot's draft of the same step, with probability 1/V.
(The end-to-end chi-square tests cannot see a draft tied to an earlier one: both stay q-marginal.)
Also: the window never drafts past the request's last token."""

from __future__ import annotations

import math

import pytest
import torch

from mmspec.drafters import JacobiDrafter
from mmspec.sampling import SamplingConfig
from mmspec.types import CommitInfo, TargetOutput

B, V, W = 20000, 8, 4
TOL = 5 * math.sqrt((1 / V) * (1 - 1 / V) / B)  # 5 sigma of a rate of 1/V over B independent rows


def _drafter(coupling):
    d = JacobiDrafter(W, coupling, vocab_size=V)
    d.prefill(torch.zeros(B, 3, dtype=torch.long), torch.ones(B, 3, dtype=torch.long),
              TargetOutput(logits=torch.zeros(B, 1, V)), {}, 50)
    return d


def _step(d, gen, n):
    """One propose + commit in which every row accepts its first n drafts."""
    roots = torch.zeros(B, dtype=torch.long)
    tokens = d.propose(roots, SamplingConfig(temperature=1.0), gen).tokens
    N = tokens.shape[1]
    info = CommitInfo(path=torch.arange(N + 1).expand(B, -1), num_accepted=torch.full((B,), n),
                      accepted_tokens=torch.where(torch.arange(N) < n, tokens, -1), next_tokens=roots,
                      num_accepted_list=[n] * B)
    d.commit(info, TargetOutput(logits=torch.zeros(B, N + 1, V)))
    return tokens


@pytest.mark.parametrize("coupling", ["maximal", "gumbel"])
def test_new_drafts_are_independent_of_what_the_verifier_saw(coupling):
    gen = torch.Generator().manual_seed(0)
    d = _drafter(coupling)
    _step(d, gen, 0)  # fill the window
    old = _step(d, gen, W - 1)  # the last draft is rejected: slot 0 is now the position after it
    new = _step(d, gen, 0)
    assert abs(float((new[:, 0] == old[:, W - 1]).double().mean()) - 1 / V) < TOL
    d = _drafter(coupling)
    _step(d, gen, 0)
    _step(d, gen, 0)
    t = _step(d, gen, 0)
    for a in range(W - 1):  # two slots of one step never share a draft or its noise
        assert abs(float((t[:, a] == t[:, a + 1]).double().mean()) - 1 / V) < TOL
    # the check's power: the coupling does tie a position's new draft to its previous one (the same
    # uniform q twice: kept), and one step on (no draft accepted) old slot 1 is new slot 0
    d = _drafter(coupling)
    _step(d, gen, 0)
    first = _step(d, gen, 0)
    again = _step(d, gen, 0)
    assert float((first[:, 1] == again[:, 0]).double().mean()) > 0.99


@pytest.mark.parametrize("T", [7, 16])
def test_the_window_never_drafts_past_the_last_token(T):
    """A step emits its accepted drafts and one more token, so with r tokens left a draft longer
    than r - 1 is verified for nothing: the window shrinks to fit (the module's Limits)."""
    from mmspec import speculative_generate
    from mmspec.models.llamagen_spec import llamagen_target

    from _llamagen_helpers import tiny_gpt

    steps = []

    class Recording(JacobiDrafter):
        def propose(self, roots, sampling, generator):
            draft = super().propose(roots, sampling, generator)
            steps.append([draft.tokens.shape[1]])
            return draft

        def commit(self, info, target_out):
            steps[-1].append(info.num_accepted_list[0])
            super().commit(info, target_out)

    out = speculative_generate(llamagen_target(tiny_gpt(4, scale=0.8), 2.0, num_tokens=T),
                               Recording(8, "gumbel", vocab_size=24), torch.tensor([[1]]), max_new_tokens=T,
                               temperature=0)
    emitted = 1  # the prefill's token
    for drafted, accepted in steps:
        assert drafted <= T - emitted - 1
        emitted += accepted + 1
    assert emitted == T == out.stats.new_tokens[0] and max(d for d, _ in steps) > 1
