"""The adaptive controllers after a request that raised mid-step (an out-of-memory error, Ctrl-C):
- `DraftLengthController`: a probe chosen for the step that raised never ran; it kept
  `_probe_base` (the next request's first ranking then re-spaced probes with an old probe's
  timing) and a pending "one-off drafting" flag (the next request's first drafting cost was not
  learnt). Both are cleared at the next request, and the probe is taken back.
- `WindowBandit` (Jacobi / tree "auto"): the interrupted request's partial tokens and seconds were
  scored as a whole request of its arm; the loop now tells it the request aborted.
Outputs after the failure equal a fresh drafter's (greedy)."""

from __future__ import annotations

import pytest
import torch

import mmspec
from mmspec.drafters import JacobiDrafter, ModelDrafter
from mmspec.models import HFTarget

from conftest import VOCAB, left_padded
from test_core_greedy import reference


class Boom(Exception):
    pass


def _run(target, drafter, ids, mask):
    return mmspec.speculative_generate(target, drafter, ids, mask, max_new_tokens=24, temperature=0)


def test_a_probe_step_that_raised_is_taken_back(target, good_drafter):
    ids, mask = left_padded([5, 8, 3, 6])
    t, d = HFTarget(target), ModelDrafter(good_drafter)
    c = d.controller
    for _ in range(3):
        _run(t, d, ids, mask)
    probes = c.probes
    c.next_probe = c.steps  # the next step probes
    seen = {}

    def verify(*args, **kwargs):  # the probe step's verify runs out of memory
        seen["probe"] = c._probe_base
        raise Boom("out of memory")

    t.verify = verify
    with pytest.raises(Boom):
        _run(t, d, ids, mask)
    del t.verify
    assert seen["probe"] is not None and c.probes == probes + 1  # a probe was chosen for that step
    c.skip_draft_cost_once()  # (a catch-up flagged in the step that raised)
    c.begin_request()
    assert c._probe_base is None and c.probes == probes and not c._skip_draft_cost
    out = _run(t, d, ids, mask)
    assert torch.equal(out.sequences, reference(target, ids, mask, 24))


def test_an_interrupted_request_is_not_scored_by_the_window_bandit(target):
    ids, mask = left_padded([5, 8, 3, 6])
    t, d = HFTarget(target), JacobiDrafter("auto", max_window=8, vocab_size=VOCAB)
    bandit = d.controller
    _run(t, d, ids, mask)
    _run(t, d, ids, mask)  # (the batch size's first, cold request is not recorded; this one will be)
    steps = [0]
    commit = d.commit

    def interrupted(info, out):
        commit(info, out)
        steps[0] += 1
        if steps[0] == 2:
            raise KeyboardInterrupt

    d.commit = interrupted
    with pytest.raises(KeyboardInterrupt):
        _run(t, d, ids, mask)
    del d.commit
    assert bandit._arm is None and bandit._tokens == 0
    out = _run(t, d, ids, mask)
    # recorded: the second request (at the third's start); not the third, which raised
    assert sum(bandit.batches[4].runs.values()) == 1
    assert torch.equal(out.sequences, reference(target, ids, mask, 24))
