"""A rule or a target written outside mmspec whose output is malformed is refused with a
ValueError / TypeError naming the class and the field, at the step it happens (a raw
AttributeError, IndexError or RuntimeError deep in the loop before). Well-formed ones decode like
plain greedy decoding, and mmspec's own rules and targets are not checked."""

from __future__ import annotations

import pytest
import torch

import mmspec
from mmspec.drafters import ModelDrafter
from mmspec.models.hf_target import HFTarget
from mmspec.types import AcceptanceResult, TargetOutput

from conftest import left_padded
from test_core_greedy import LENGTHS, reference


class CustomGreedy:
    """A greedy rule of its own (the AcceptanceRule protocol); `mangle` edits its result."""

    lossless = True

    def __init__(self, mangle=None):
        self.mangle = mangle

    def verify(self, draft_tokens, draft_probs, target_probs, generator=None):
        best = target_probs.argmax(-1)  # [B, K+1]
        hits = (best[:, :-1] == draft_tokens).long().cumprod(1)
        n = hits.sum(1)
        res = AcceptanceResult(num_accepted=n, next_tokens=best.gather(1, n.unsqueeze(1)).squeeze(1))
        return self.mangle(res) if self.mangle else res

    def sample(self, probs, generator=None):
        return probs.argmax(-1)

    def accept_probability(self, x, p, q):  # (trees: a node is kept when it is the target's argmax)
        return (p.argmax(-1) == x).to(p.dtype)

    def residual(self, x, p, q):
        return p


class Wrapped:
    """A target of its own around an HFTarget; `mangle` edits what prefill / verify return."""

    def __init__(self, model, mangle=None):
        self.inner, self.mangle = HFTarget(model), mangle or (lambda method, out: out)
        self.vocab_size = self.inner.vocab_size

    def prefill(self, *args):
        return self.mangle("prefill", self.inner.prefill(*args))

    def verify(self, tokens, parents):
        return self.mangle("verify", self.inner.verify(tokens, parents))

    def commit(self, info):
        self.inner.commit(info)

    def select_rows(self, rows, rows_host):
        self.inner.select_rows(rows, rows_host)


def _run(target, drafter, n=6, acceptance="exact"):
    ids, mask = left_padded(LENGTHS)
    out = mmspec.speculative_generate(target, drafter, ids, mask, temperature=0, max_new_tokens=n,
                                      acceptance=acceptance)
    return out, ids, mask


def test_well_formed_custom_rule_and_target_decode_like_plain_greedy(target, good_drafter):
    for tgt, rule in ((target, CustomGreedy()), (Wrapped(target), "exact"), (Wrapped(target), CustomGreedy())):
        out, ids, mask = _run(tgt, ModelDrafter(good_drafter, 3), n=10, acceptance=rule)
        assert torch.equal(out.sequences, reference(target, ids, mask, 10))


@pytest.mark.parametrize("mangle, error, message", [
    (lambda r: (r.num_accepted, r.next_tokens), TypeError,
     r"CustomGreedy.verify must return a mmspec.types.AcceptanceResult, got tuple"),
    (lambda r: AcceptanceResult(r.num_accepted.int(), r.next_tokens), ValueError,
     r"CustomGreedy.verify returned num_accepted of torch.int32 \(4,\); it must be a torch.long tensor \[4\]"),
    (lambda r: AcceptanceResult(r.num_accepted[:1], r.next_tokens), ValueError, r"num_accepted of torch.int64 \(1,\)"),
    (lambda r: AcceptanceResult(r.num_accepted + 4, r.next_tokens), ValueError,
     r"CustomGreedy.verify accepted \[.*\] drafts per row of 3; num_accepted must be between 0 and 3"),
    (lambda r: AcceptanceResult(r.num_accepted - 4, r.next_tokens), ValueError, r"must be between 0 and 3"),
    (lambda r: AcceptanceResult(r.num_accepted, r.next_tokens + 40), ValueError,
     r"CustomGreedy.verify returned next_tokens \[.*\] outside the vocabulary 0\.\.39"),
])
def test_malformed_rule_results_are_refused_by_name(target, good_drafter, mangle, error, message):
    with pytest.raises(error, match=message):
        _run(target, ModelDrafter(good_drafter, 3), acceptance=CustomGreedy(mangle))


@pytest.mark.parametrize("where, mangle, error, message", [
    ("prefill", lambda out: out.logits, TypeError, r"Wrapped.prefill must return a mmspec.types.TargetOutput, got Tensor"),
    ("verify", lambda out: TargetOutput(logits=out.logits[:, :1]), ValueError,
     r"Wrapped.verify returned logits \(4, 1, 40\); they must be \[4, 4, 40\]"),
    ("prefill", lambda out: TargetOutput(logits=out.logits[..., :32]), ValueError,
     r"Wrapped.prefill returned logits \(4, \d+, 32\); they must be \[4, L, 40\]"),
])
def test_malformed_target_outputs_are_refused_by_name(target, good_drafter, where, mangle, error, message):
    wrapped = Wrapped(target, lambda method, out: mangle(out) if method == where else out)
    with pytest.raises(error, match=message):
        _run(wrapped, ModelDrafter(good_drafter, 3))


def test_mmspec_rules_and_targets_are_not_checked(target, good_drafter, monkeypatch):
    import mmspec.engine as engine

    calls = []
    for name in ("check_verdict", "check_target_output"):
        check = getattr(engine, name)
        monkeypatch.setattr(engine, name, lambda *a, check=check: (calls.append(1), check(*a))[1])
    out, ids, mask = _run(target, ModelDrafter(good_drafter, 3), n=6)
    assert torch.equal(out.sequences, reference(target, ids, mask, 6)) and not calls
    _run(Wrapped(target), ModelDrafter(good_drafter, 3), n=6, acceptance=CustomGreedy())
    assert calls  # (the same counter sees the custom ones)


def test_a_subclass_overriding_only_prefill_or_verify_is_checked_there(target, good_drafter):
    class ShortPrefill(HFTarget):
        def prefill(self, *args):
            out = super().prefill(*args)
            return TargetOutput(logits=out.logits[..., :-1])

    with pytest.raises(ValueError, match=r"ShortPrefill.prefill returned logits \(4, \d+, 39\); they must be "):
        _run(ShortPrefill(target), ModelDrafter(good_drafter, 3))


def test_a_user_subclass_overriding_verify_is_what_runs(target, good_drafter):
    """A subclass of an mmspec chain rule whose own `verify` overrides the inherited one: the loop
    ran the inherited `verify_unchecked`, so the override was silently skipped."""
    from mmspec.acceptance import ExactAcceptance

    calls = []

    class Counting(ExactAcceptance):
        def verify(self, draft_tokens, draft_probs, target_probs, *, generator=None):
            calls.append(draft_tokens.shape)
            return super().verify(draft_tokens, draft_probs, target_probs, generator=generator)

    ids, mask = left_padded(LENGTHS)
    out = mmspec.speculative_generate(target, ModelDrafter(good_drafter, 3), ids, mask, temperature=1.0,
                                      max_new_tokens=6, acceptance=Counting(), generator=torch.Generator().manual_seed(0))
    assert len(calls) == len(out.stats.nodes_per_step) > 1  # every step (an overridden verify gets K = 0 steps too)


@pytest.mark.parametrize("kind", ["greedy-subclass", "mixin", "invariant-subclass"])
def test_a_users_own_verify_runs_at_every_step_whatever_the_class_layout(target, good_drafter, kind):
    """Greedy rules took a plain-argmax shortcut on K = 0 steps, a mixin's verify placed first in the
    class order was skipped, and the position-keyed path called the inherited verify_top."""
    from mmspec.acceptance import ExactAcceptance
    from mmspec.acceptance.greedy import GreedyAcceptance
    from mmspec.acceptance.invariant import DrafterInvariantAcceptance
    from mmspec.drafters import NullDrafter

    calls = []

    class Counting:  # a mixin placed first in the class order
        def verify(self, draft_tokens, draft_probs, target_probs, *, generator=None):
            calls.append(draft_tokens.shape[1])
            return super().verify(draft_tokens, draft_probs, target_probs, generator=generator)

    class Greedy(GreedyAcceptance):
        def verify(self, draft_tokens, draft_probs, target_probs, *, generator=None):
            calls.append(draft_tokens.shape[1])
            return super().verify(draft_tokens, draft_probs, target_probs, generator=generator)

    class Invariant(DrafterInvariantAcceptance):
        def verify(self, draft_tokens, draft_probs, target_probs, *, generator=None):
            calls.append(draft_tokens.shape[1])
            return super().verify(draft_tokens, draft_probs, target_probs, generator=generator)

    class Mixed(Counting, ExactAcceptance):
        pass

    rule = {"greedy-subclass": Greedy, "mixin": Mixed, "invariant-subclass": Invariant}[kind]()
    ids, mask = left_padded(LENGTHS)
    for drafter in (ModelDrafter(good_drafter, 3), NullDrafter(40)):
        calls.clear()
        out = mmspec.speculative_generate(target, drafter, ids, mask, max_new_tokens=6, acceptance=rule,
                                          temperature=0 if kind == "greedy-subclass" else 1.0,
                                          generator=torch.Generator().manual_seed(0))
        assert len(calls) == len(out.stats.nodes_per_step) > 1
