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


def test_a_request_failing_in_the_targets_prefill_keeps_the_last_requests_score(target):
    """The bandit scores request n when request n+1's drafter prefill begins; a request n+1 that
    failed before that (in the target's prefill) wiped request n's score."""
    ids, mask = left_padded([5, 8, 3, 6])
    t, d = HFTarget(target), JacobiDrafter("auto", max_window=8, vocab_size=VOCAB)
    bandit = d.controller
    _run(t, d, ids, mask)
    _run(t, d, ids, mask)  # the second request: scored when the next one begins
    prefill = t.prefill

    def failing(*args, **kwargs):
        raise Boom("out of memory in the prompt")

    t.prefill = failing
    with pytest.raises(Boom):
        _run(t, d, ids, mask)
    t.prefill = prefill
    _run(t, d, ids, mask)
    assert sum(bandit.batches[4].runs.values()) == 1  # the second request's score survived


def test_a_request_stopped_by_its_target_is_not_scored(target):
    """A stop (the image pipeline's callback) ends a request early: its rate over the first steps
    is not a whole request's."""
    ids, mask = left_padded([5, 8, 3, 6])
    t, d = HFTarget(target), JacobiDrafter("auto", max_window=8, vocab_size=VOCAB)
    bandit = d.controller
    _run(t, d, ids, mask)
    _run(t, d, ids, mask)
    commit, steps = t.commit, [0]

    def stopping(info):
        commit(info)
        steps[0] += 1
        t.stop_requested = steps[0] >= 2

    t.commit = stopping
    out = _run(t, d, ids, mask)
    assert max(out.stats.new_tokens) < 24  # stopped early
    del t.commit
    t.stop_requested = False
    _run(t, d, ids, mask)
    assert sum(bandit.batches[4].runs.values()) == 1  # the second request only


def test_a_propose_set_on_the_instance_is_checked(target):
    from mmspec.types import Draft

    ids, mask = left_padded([5, 8, 3, 6])
    d = ModelDrafter(target, 2)
    propose = d.propose
    d.propose = lambda roots, s, g: Draft(tokens=propose(roots, s, g).tokens + VOCAB,
                                          parents=torch.tensor([[-1, 0]] * roots.shape[0]))
    with pytest.raises(ValueError, match=r"drafted token ids outside the target's vocabulary"):
        _run(target, d, ids, mask)
