"""Shadow probes (mmspec/shadow_acceptance.py): under greedy decoding a probe from plain decoding
reads acceptance off the plain stretch (the drafter's teacher-forced predictions) instead of
drafting. Checked against an independent computation (the drafter model run once over each
row's whole sequence), together with the identity it rests on (a chain's accepted length is the
run of teacher-forced agreements from its root), and the output stays plain greedy's."""

from __future__ import annotations

import random

import pytest
import torch

import mmspec
from mmspec.acceptance import ExactAcceptance
from mmspec.adaptive import DraftLengthController
from mmspec.drafters import ModelDrafter
from mmspec.shadow_acceptance import chain_counts

from conftest import left_padded
from test_core_adaptive import feed, flat_verify


def test_chain_counts_follow_the_definition():
    """Position i of a chain started at j is tried when flags j .. j+i-1 all hold and accepted
    when flag j+i holds too; positions past a row's last flag are not counted."""
    rnd = random.Random(0)
    for _ in range(200):
        k_max = rnd.randint(1, 6)
        rows = [[rnd.random() < 0.6 for _ in range(rnd.randint(0, 12))] for _ in range(rnd.randint(1, 4))]
        tried, acc = [0] * k_max, [0] * k_max
        for row in rows:
            for j in range(len(row)):
                for i in range(k_max):
                    if j + i < len(row) and all(row[j:j + i]):
                        tried[i] += 1
                        acc[i] += row[j + i]
        got = chain_counts(rows, k_max)
        assert (got[0], got[1]) == (tried, acc)
        assert got[2] == [(sum(r), len(r)) for r in rows]


class Scripted(DraftLengthController):
    """K from a plan ("s": a shadow probe, i.e. K = 0 with the drafter asked to measure);
    records what the loop and the drafter report."""

    def __init__(self, plan):
        super().__init__(4, probe_every=0)
        self.plan, self.log = plan, []

    def choose(self, batch, remaining=None):
        k = self.plan[self.steps % len(self.plan)]
        self.steps += 1
        if k == "s":
            assert self.shadow_capable
            self._shadow_due, k = True, 0
        self.log.append(["step", k])
        return k

    def observe_shadow(self, hits):
        self.log.append(["shadow", hits])
        super().observe_shadow(hits)

    def observe(self, batch, k, accepted, *args, rows=None, **kw):
        self.log.append(["accepted", k, list(accepted), list(rows)])
        super().observe(batch, k, accepted, *args, rows=rows, **kw)


@pytest.mark.parametrize("plan, window", [(["s", 3, 0, 0, "s", 2, 0, 0, 0, "s", "s", 4, "s", 1, 0, "s", 0, 3], 32),
                                          ([0, 0, 0, 0, 0, "s", 4, 4, 0, 0, "s", 2, 2, "s"], 32),
                                          ([0, 0, 0, 0, 0, 0, "s", 4, 0, 0, 0, 0, 0, 0, 0, "s", 1], 3)])
def test_shadow_hits_are_the_teacher_forced_agreements_and_chains_accept_their_runs(target, good_drafter, plan,
                                                                                     window):
    """`window`: the shadow reads each row's last `window` stretch tokens (3: shorter than the
    stretches here, so the cut is exercised)."""
    lengths = [9, 4, 6]
    ids, mask = left_padded(lengths)
    N = 36
    ref = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=N, pad_token_id=0,
                          eos_token_id=2)
    assert (ref[:, ids.shape[1]:] == 2).any()  # a row ends early and leaves the batch
    drafter = ModelDrafter(good_drafter, "auto", max_draft_tokens=4)
    drafter.controller = ctrl = Scripted(plan)
    drafter.shadow_window = window
    out = mmspec.speculative_generate(target, drafter, ids, mask, temperature=0, max_new_tokens=N, pad_token_id=0,
                                      eos_token_id=2)
    assert torch.equal(out.sequences, ref)
    # Independent: the drafter over each row's whole unpadded sequence (to its EOS), once.
    agree = []
    for b, n in enumerate(lengths):
        seq = ref[b, ids.shape[1] - n:]
        seq = seq[:n + 1 + int((seq[n:] == 2).long().argmax())] if (seq[n:] == 2).any() else seq
        pred = good_drafter(seq.unsqueeze(0)).logits[0].argmax(-1)
        agree.append((pred[:-1] == seq[1:]).tolist())  # agree[t]: the prediction after token t is token t+1
    root = list(lengths)  # index of each row's current root (the first new token)
    seen = list(lengths)  # tokens the drafter has run (its deferred prefill: the prompt)
    k, shadows, drafted, hits = None, 0, 0, None
    for entry in ctrl.log:
        if entry[0] == "step":
            k = entry[1]
        elif entry[0] == "shadow":
            hits = entry[1]  # rows: those of this step's observe
        else:
            _, kk, accepted, rows = entry
            # the chain that ran: the controller's K, held to what the step's longest row can
            # still emit (N new tokens, the root among them)
            assert kk == min(k, max(N - (root[b] - lengths[b] + 1) for b in rows) - 1)
            k = kk
            if hits is not None:
                shadows += 1
                assert hits == [agree[b][max(seen[b], root[b] - window):root[b]] for b in rows]
                for b in rows:
                    seen[b] = root[b] + 1  # caught up through the root
                hits = None
            for b, n in zip(rows, accepted):
                if k > 0 and root[b] + k < len(agree[b]):
                    run = 0
                    while run < k and agree[b][root[b] + run]:
                        run += 1
                    assert n == run, (b, root[b], k)  # the chain accepted its teacher-forced run
                    drafted += 1
                if k > 0:
                    seen[b] = root[b] + 1 + min(n, k - 1)  # the root and the kept drafts it ran
                root[b] += n + 1
    assert shadows >= 3 and drafted >= 4
    longest = max(len(h) for e in ctrl.log if e[0] == "shadow" for h in e[1])
    assert longest == window if window < 6 else longest > 3  # stretches were read (and cut at the window)


def test_shadow_probes_only_under_greedy_lossless_decoding(target, good_drafter):
    ids, mask = left_padded([5, 7])
    d = ModelDrafter(good_drafter, "auto", max_draft_tokens=4)
    mmspec.speculative_generate(target, d, ids, mask, temperature=0, max_new_tokens=6, pad_token_id=0)
    assert d.controller.shadow_capable
    g = torch.Generator().manual_seed(0)
    mmspec.speculative_generate(target, d, ids, mask, temperature=1.0, max_new_tokens=6, pad_token_id=0, generator=g)
    assert not d.controller.shadow_capable  # sampling: acceptance is not a match of argmaxes
    mmspec.speculative_generate(target, d, ids, mask, temperature=0, max_new_tokens=6, pad_token_id=0,
                                acceptance="typical")
    assert d.controller.shadow_capable  # typical acceptance at temperature 0 accepts the argmax only (lossless)

    class Relaxed(ExactAcceptance):  # a lossy rule (it may accept more than the argmax matches)
        lossless = False

        def at_temperature_zero(self):
            return self

    mmspec.speculative_generate(target, d, ids, mask, temperature=0, max_new_tokens=6, pad_token_id=0,
                                acceptance=Relaxed())
    assert not d.controller.shadow_capable


def test_a_probe_from_plain_decoding_is_a_shadow_that_can_switch_speculation_on():
    """Fed a pair whose drafts are rejected, the controller settles on K = 0; with shadows its
    probes from plain stay plain (no drafting step after the warm-up), and a shadow reporting a
    stretch of agreements switches speculation on at the next step."""
    ctrl = DraftLengthController(4, probe_every=16, max_probe_every=64)
    ctrl.shadow_capable = True
    shadows = 0
    for _ in range(300):
        k = ctrl.choose(1)
        if ctrl.take_shadow():
            shadows += 1
            ctrl.observe_shadow([[False] * 20])
        ctrl.observe(1, k, [0], 0.002 * k, flat_verify(1, k + 1))
    assert shadows >= 3 and all(k == 0 for k in ctrl.history[len(ctrl.warmup) + 3:])
    while not (ctrl.choose(1) == 0 and ctrl.take_shadow()):
        ctrl.observe(1, ctrl.history[-1], [0], 0.0, flat_verify(1, 1))
    ctrl.observe_shadow([[True] * 40])
    ctrl.observe(1, 0, [0], 0.0, flat_verify(1, 1))
    assert ctrl.choose(1) > 0
    # Without shadows the same pair probes by drafting.
    plain = DraftLengthController(4, probe_every=16, max_probe_every=64)
    feed(plain, 1, 300, 0.0, flat_verify, 0.002)
    assert any(k > 0 for k in plain.history[len(plain.warmup) + 3:])


@pytest.mark.parametrize("window", [0, -3, 2.5, True, "32"])
def test_a_shadow_window_that_cannot_be_honoured_is_refused_by_name(target, good_drafter, window):
    ids, mask = left_padded([5, 7])
    d = ModelDrafter(good_drafter, "auto", max_draft_tokens=4)
    d.shadow_window = window
    with pytest.raises(ValueError, match="shadow_window must be an int >= 1"):
        mmspec.speculative_generate(target, d, ids, mask, temperature=0, max_new_tokens=6, pad_token_id=0)
    d.shadow_window = 5  # a valid window runs (and greedy output is plain greedy output: the other tests)
    mmspec.speculative_generate(target, d, ids, mask, temperature=0, max_new_tokens=6, pad_token_id=0)
