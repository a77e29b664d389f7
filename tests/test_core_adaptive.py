"""Adaptive draft length (`num_draft_tokens="auto"`): lossless (greedy equality and the exact
sampling chi-square hold whatever K the controller picks), and the controller's choices
follow measured costs and acceptance (fed synthetic measurements, so deterministic)."""

from __future__ import annotations

import pytest
import torch

import mmspec
from mmspec.adaptive import DraftLengthController
from mmspec.drafters import ModelDrafter

from conftest import left_padded, noisy_copy, tiny_llama
from test_core_sampling import V, chi_square_p, joint_23


def test_auto_greedy_equals_generate(target, weak_drafter, good_drafter):
    ids, mask = left_padded([9, 5, 7, 3])
    ref = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=40, pad_token_id=0,
                          eos_token_id=2)
    assert (ref[:, ids.shape[1]:] == 2).any()  # a row ends early: EOS handling is exercised too
    for model in (weak_drafter, good_drafter, target):
        drafter = ModelDrafter(model)  # "auto" is the default for chains
        out = mmspec.speculative_generate(target, drafter, ids, mask, temperature=0, max_new_tokens=40,
                                          eos_token_id=2, pad_token_id=0)
        assert torch.equal(out.sequences, ref)
        ks = out.stats.nodes_per_step
        assert len(set(ks)) > 1 and max(ks) <= 8  # K really varied (warm-up probes at least)


def test_auto_with_zero_steps_in_between_stays_exact(target, good_drafter):
    """Force K = 0 on some steps (the drafter then defers its catch-up) and K > 0 on others."""
    ids, mask = left_padded([6, 4])
    ref = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=30, pad_token_id=0,
                          eos_token_id=2)
    drafter = ModelDrafter(good_drafter, "auto", max_draft_tokens=5)
    drafter.controller = DraftLengthController(5, warmup=(0, 0, 3, 0, 5, 0, 0, 0, 2, 1, 0, 4) * 3, probe_every=0)
    out = mmspec.speculative_generate(target, drafter, ids, mask, temperature=0, max_new_tokens=30, eos_token_id=2,
                                      pad_token_id=0)
    assert torch.equal(out.sequences, ref)
    assert 0 in out.stats.nodes_per_step and 5 in out.stats.nodes_per_step


def test_drafter_prefill_is_deferred_to_the_first_drafting_step(target, good_drafter):
    """An adaptive drafter runs its prompt prefill at the first step that drafts: a request
    decoded plainly throughout never runs the drafter, and rows that end (EOS) before the
    drafter first runs are dropped from the deferred prefill too; the output stays exact."""
    ids, mask = left_padded([9, 5, 7, 3])
    ref = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=40, pad_token_id=0,
                          eos_token_id=2)
    new = ref[:, ids.shape[1]:]
    first_eos = int((new == 2).float().argmax(1)[(new == 2).any(1)].min())
    assert first_eos < 30  # a row ends while the drafter has not run yet
    plain = ModelDrafter(good_drafter, "auto", max_draft_tokens=4)
    plain.controller = DraftLengthController(4, warmup=(0,) * 40, probe_every=0)
    out = mmspec.speculative_generate(target, plain, ids, mask, temperature=0, max_new_tokens=40, eos_token_id=2,
                                      pad_token_id=0)
    assert torch.equal(out.sequences, ref)
    assert plain.draft_calls == 0 and set(out.stats.nodes_per_step) == {0}
    late = ModelDrafter(good_drafter, "auto", max_draft_tokens=4)
    late.controller = DraftLengthController(4, warmup=(0,) * (first_eos + 2) + (4,) * 40, probe_every=0)
    out = mmspec.speculative_generate(target, late, ids, mask, temperature=0, max_new_tokens=40, eos_token_id=2,
                                      pad_token_id=0)
    assert torch.equal(out.sequences, ref)
    assert late.draft_calls > 1 and 4 in out.stats.nodes_per_step


def test_probes_back_off_while_they_change_nothing_and_recovery_is_still_found():
    """A pair whose speculation never pays: the gap between probes doubles up to
    max_probe_every, so far fewer drafting steps than one probe every probe_every steps;
    when acceptance recovers, speculation is back on within a few max_probe_every (a probe
    moves the discounted acceptance estimate only part of the way)."""
    ctrl = DraftLengthController(8, probe_every=16, max_probe_every=64)
    feed(ctrl, 1, 600, 0.02, flat_verify, 0.002)
    spec_steps = [i for i, k in enumerate(ctrl.history) if k > 0 and i >= len(ctrl.warmup)]
    assert 3 <= len(spec_steps) <= 12, spec_steps  # a probe every 16 steps would give 37
    gaps = [b - a for a, b in zip(spec_steps, spec_steps[1:])]
    # Each gap is the last one or its double, from probe_every (or its double) up to the cap.
    assert all(b in (a, 2 * a) for a, b in zip(gaps, gaps[1:])) and gaps[0] <= 32 and max(gaps) == 64, gaps
    start = len(ctrl.history)
    feed(ctrl, 1, 200, 0.95, flat_verify, 0.002, seed=1)
    on = next(i for i in range(start, len(ctrl.history) - 3) if all(k > 0 for k in ctrl.history[i:i + 4]))
    assert on - start <= 3 * 64
    assert sum(ctrl.history[-20:]) / 20 >= 3


def test_expensive_probes_are_spaced_to_the_probe_budget():
    """When a probe costs several plain steps (here 0.05 s of drafting against a 0.0101 s plain
    step), the gap grows past max_probe_every until probing takes about probe_budget of the
    plain time, and never past budget_gap_factor * max_probe_every."""
    ctrl = DraftLengthController(8, probe_every=16, max_probe_every=64, probe_budget=0.02)
    feed(ctrl, 1, 2000, 0.02, flat_verify, 0.05)
    spec_steps = [i for i, k in enumerate(ctrl.history) if k > 0 and i >= len(ctrl.warmup)]
    gaps = [b - a for a, b in zip(spec_steps, spec_steps[1:])]
    assert gaps and all(200 <= g <= 256 for g in gaps[1:]), gaps
    plain = flat_verify(1, 1)
    extra = sum(0.05 * ctrl.history[i] + flat_verify(1, ctrl.history[i] + 1) - plain for i in spec_steps[1:])
    assert extra / (plain * (len(ctrl.history) - spec_steps[1])) < 0.03
    # A probe worth ~10 plain steps at the default 1% budget asks for gaps of ~1000 steps,
    # past the old cap of 4 * max_probe_every (256); one worth ~50 is capped at
    # budget_gap_factor * max_probe_every (1024).
    for drafting, lo, hi in ((0.1, 900, 1023), (0.5, 1024, 1024)):
        costly = DraftLengthController(8, probe_every=16, max_probe_every=64)
        feed(costly, 1, 5000, 0.02, flat_verify, drafting)
        spec_steps = [i for i, k in enumerate(costly.history) if k > 0 and i >= len(costly.warmup)]
        gaps = [b - a for a, b in zip(spec_steps, spec_steps[1:])]
        assert len(gaps) >= 3 and all(lo <= g <= hi for g in gaps[1:]), gaps
    # A cheap probe keeps the plain back-off (at most max_probe_every).
    cheap = DraftLengthController(8, probe_every=16, max_probe_every=64)
    feed(cheap, 1, 600, 0.02, flat_verify, 0.002)
    steps = [i for i, k in enumerate(cheap.history) if k > 0 and i >= 3]
    assert max(b - a for a, b in zip(steps, steps[1:])) == 64


def test_a_probe_is_charged_net_of_the_tokens_it_emits():
    """Batch 8, a margin so large that K = 1 is never chosen although it pays per token: each
    K = 1 probe costs 2x a plain step (0.020 s of verify + 0.012 s of drafting vs 0.016 s) and
    emits 1.9 tokens a row. Charged net of its tokens it costs nothing, so the gaps stay within
    max_probe_every; charged as its whole extra time (the planted bug: 1 plain step a probe at
    a 1% budget = 100 steps) they would grow past it."""
    # k_max = 1: from plain decoding the probe is K = 1 (with longer drafts allowed it would be
    # the best K by the estimates).
    ctrl = DraftLengthController(1, warmup=(), probe_every=16, max_probe_every=64, min_gain=0.9)
    feed(ctrl, 8, 800, 0.9, lambda b, q: 0.010 + 0.0006 * b * q, 0.0015)
    probes = [i for i, k in enumerate(ctrl.history) if k > 0]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert max(gaps) == 64, gaps
    plain, probe = 0.010 + 0.0006 * 8, 0.010 + 0.0006 * 16 + 0.0015 * 8
    assert probe > 1.9 * plain and (probe - plain) / (0.01 * plain) > 64  # the bug would space them wider


def test_one_off_drafting_work_is_not_learnt_as_the_drafting_cost():
    ctrl = DraftLengthController(4, warmup=(2,), probe_every=0)
    ctrl.choose(1)
    ctrl.observe(1, 2, [2], 0.002, 0.010)
    assert abs(ctrl.draft.estimate((1, 2), 2) - 0.002) < 1e-12
    ctrl.choose(1)
    ctrl.skip_draft_cost_once()  # e.g. a catch-up over 40 deferred tokens
    ctrl.observe(1, 2, [2], 0.500, 0.010)
    assert abs(ctrl.draft.estimate((1, 2), 2) - 0.002) < 1e-12
    ctrl.choose(1)
    ctrl.observe(1, 2, [2], 0.004, 0.010)  # the flag lasts one step
    assert ctrl.draft.estimate((1, 2), 2) > 0.002


def test_auto_exact_sampling_matches_enumerated_joint():
    target = tiny_llama(layers=2, seed=3, vocab=V, hidden=16)
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)
    drafter = ModelDrafter(noisy_copy(target, 0.6, seed=9), "auto", max_draft_tokens=3)
    prompt = torch.tensor([[1, 5, 3, 6]])
    sampling = mmspec.SamplingConfig(1.0, None)
    n = 12000
    out = mmspec.speculative_generate(target, drafter, prompt.expand(n, -1), temperature=1.0, max_new_tokens=3,
                                      generator=torch.Generator().manual_seed(11))
    new = out.sequences[:, 4:]
    counts = torch.zeros(V, V)
    counts.index_put_((new[:, 1], new[:, 2]), torch.ones(n), accumulate=True)
    assert chi_square_p(counts, joint_23(target, prompt, sampling), n) > 1e-4
    assert chi_square_p(counts, joint_23(drafter.model, prompt, sampling), n) < 1e-4  # power


def feed(ctrl, batch, steps, accept_prob, verify_s, draft_per_token_s, seed=0):
    """Drive the controller with synthetic steps: each row accepts each draft with accept_prob."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        k = ctrl.choose(batch)
        accepted = []
        for _ in range(batch):
            n = 0
            while n < k and torch.rand(1, generator=g).item() < accept_prob:
                n += 1
            accepted.append(n)
        ctrl.observe(batch, k, accepted, draft_per_token_s * k * batch, verify_s(batch, k + 1))
    return ctrl.history[-8:]


def flat_verify(b, q):  # memory-bound: a verify costs about one step whatever its width
    return 0.010 + 0.0001 * b * q


def test_controller_goes_long_with_good_drafts_and_off_with_bad_ones():
    good = feed(DraftLengthController(8), 1, 60, 0.95, flat_verify, 0.0005)
    assert sum(good) / len(good) >= 6
    bad = feed(DraftLengthController(8), 1, 60, 0.02, flat_verify, 0.002)
    assert sum(k == 0 for k in bad) >= 6  # speculation switched off (probes aside)
    # Compute-bound verify at a large batch: long drafts stop paying.
    wide = feed(DraftLengthController(8), 16, 60, 0.7, lambda b, q: 0.002 * b * q, 0.0001)
    assert max(wide[:-1]) <= 3


def test_controller_switches_back_on_when_acceptance_recovers():
    ctrl = DraftLengthController(8)
    feed(ctrl, 1, 60, 0.02, flat_verify, 0.002)
    assert ctrl.history[-1] == 0 or ctrl.history[-2] == 0
    recovered = feed(ctrl, 1, 80, 0.95, flat_verify, 0.002, seed=1)
    assert sum(recovered) / len(recovered) >= 3


def test_plain_stretches_are_re_ranked_every_few_steps_only(monkeypatch):
    """While plain (K = 0) with no probe due, the full ranking runs every `replan_every` steps,
    not on every step; probes and the step after them still rank afresh."""
    ctrl = DraftLengthController(8)
    feed(ctrl, 1, 60, 0.02, flat_verify, 0.002)  # speculation off
    assert ctrl.history[-1] == 0 or ctrl.history[-2] == 0
    calls = []
    original = ctrl._rates
    monkeypatch.setattr(ctrl, "_rates", lambda *a: calls.append(ctrl.steps) or original(*a))
    probes = ctrl.probes
    feed(ctrl, 1, 80, 0.02, flat_verify, 0.002, seed=2)
    probed = ctrl.probes - probes
    assert probed >= 1  # the back-off still probes
    assert ctrl.replan_every == 4 and len(calls) <= 80 // 4 + 3 * probed + 2
    assert sum(k == 0 for k in ctrl.history[-80:]) >= 80 - 2 * probed  # and stays plain


def test_a_request_that_ended_plain_does_not_start_the_next_one_plain():
    """The last steps of a request are plain when one token is left (a draft past the budget is
    never emitted); the next request's budgets are whole again, so its first step drafts. Before,
    the re-ranking shortcut of plain stretches kept K = 0 for the first 3 steps of every request
    (seen on the 69% bench pair at batch 1: every request after the first began 0, 0, 0)."""
    ctrl = DraftLengthController(8)
    g = torch.Generator().manual_seed(0)
    ended_plain, checked = False, 0
    for request in range(24):
        ctrl.begin_request()
        left, ks = 48, []
        while left > 0:
            k = ctrl.choose(1, [left])
            ks.append(k)
            n = 0
            while n < k and torch.rand(1, generator=g).item() < 0.8:
                n += 1
            ctrl.observe(1, k, [n], 0.0005 * k, flat_verify(1, k + 1), rows=[0])
            left -= min(n + 1, left)
        if ended_plain:
            assert ks[0] > 0 and ks[1] > 0, ks  # the request after one that ended plain drafts at once
            checked += 1
        ended_plain = ks[-1] == 0  # (one token was left: only a plain step makes sense)
    assert checked >= 3


def test_a_burst_of_rejections_does_not_keep_speculation_off():
    """Batch 4, acceptance 0.7 where K > 0 clearly pays, then 12 steps where every draft is
    rejected (the loop goes plain within a few), then 0.7 again. While plain, no draft is judged,
    so without relaxing toward the long-run rate the burst's estimate held until a probe moved
    it (measured: back on after 18-187 steps over 6 seeds, and after the first probe changed
    nothing the back-off spaced the next ones out); relaxing, it is back within 8 steps."""

    def verify(b, q):
        return 0.010 + 0.001 * b * q

    def resume(relax):
        out = []
        for seed in range(6):
            ctrl = DraftLengthController(8)
            ctrl.relax = relax
            feed(ctrl, 4, 300, 0.7, verify, 0.0005, seed=seed)
            feed(ctrl, 4, 12, 0.0, verify, 0.0005, seed=seed + 10)
            assert 0 in ctrl.history[-12:]  # the burst switched speculation off
            start = len(ctrl.history)
            feed(ctrl, 4, 200, 0.7, verify, 0.0005, seed=seed + 20)
            out.append(next(i for i in range(start, len(ctrl.history) - 3)
                            if all(k > 0 for k in ctrl.history[i:i + 4])) - start)
        return out

    assert max(resume(0.97)) <= 12
    assert sum(resume(1.0)) / 6 >= 40  # the planted bug: no relaxation


def test_controller_needs_a_margin_to_switch_speculation_on():
    # Every draft accepted, but a draft token costs 0.0097 s against a 0.0101 s verify: with the
    # acceptance estimate at 1 (plain stretches relax it toward the long-run rate) K = 1 beats
    # plain decoding by 1.5% in the cost model (2 / (0.0102 + 0.0097) vs 1 / 0.0101) and K = 8,
    # the best, by 2.7% (9 / (0.0109 + 8 x 0.0097)), below the default 4% margin.
    marginal = feed(DraftLengthController(8), 1, 60, 1.0, flat_verify, 0.0097)
    assert sum(k == 0 for k in marginal) >= 7  # plain (one probe at most)
    eager = feed(DraftLengthController(8, min_gain=0.0), 1, 60, 1.0, flat_verify, 0.0097)
    assert sum(k > 0 for k in eager) >= 7  # without the margin the tie goes to speculation
    # A clear gain is taken with the margin too.
    clear = feed(DraftLengthController(8), 1, 60, 1.0, flat_verify, 0.004)
    assert sum(k > 0 for k in clear) >= 7


def test_plain_step_shortcut_matches_the_rule_path(target):
    """K = 0 steps skip the chain machinery for rules whose K = 0 verdict is "sample the
    target". A subclass that overrides `verify_unchecked` (same maths) takes the general path:
    both give the same tokens for the same seed, sampled and greedy, EOS included."""
    from mmspec.acceptance import ExactAcceptance
    from mmspec.drafters.null_drafter import NullDrafter

    class Slow(ExactAcceptance):
        def verify_unchecked(self, *args, **kwargs):
            return super().verify_unchecked(*args, **kwargs)

    ids, mask = left_padded([9, 5, 7, 3])
    for temperature in (0.0, 1.0):
        outs = []
        for rule in (ExactAcceptance(), Slow()):
            outs.append(mmspec.speculative_generate(
                target, NullDrafter(target.config.vocab_size), ids, mask, acceptance=rule,
                temperature=temperature, max_new_tokens=30, eos_token_id=2, pad_token_id=0,
                generator=torch.Generator().manual_seed(5)))
        assert torch.equal(outs[0].sequences, outs[1].sequences)
        assert outs[0].stats.new_tokens == outs[1].stats.new_tokens
    ref = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=30, pad_token_id=0,
                          eos_token_id=2)
    greedy = mmspec.speculative_generate(target, NullDrafter(target.config.vocab_size), ids, mask, temperature=0,
                                         max_new_tokens=30, eos_token_id=2, pad_token_id=0)
    assert torch.equal(greedy.sequences, ref)


def test_greedy_plain_steps_take_the_shortcut_with_the_rule_path_tokens(target, monkeypatch):
    """Greedy verification's K = 0 verdict is the target's argmax (`GreedyAcceptance.sample`),
    so greedy plain steps skip the chain machinery too; a subclass that overrides
    `verify_unchecked` or `sample` takes the general path. Same tokens and counts either way,
    EOS and prompts of different lengths included, equal to `generate`."""
    import mmspec.engine as engine
    from mmspec.acceptance import GreedyAcceptance
    from mmspec.drafters.null_drafter import NullDrafter

    class SlowVerify(GreedyAcceptance):
        def verify_unchecked(self, *args, **kwargs):
            return super().verify_unchecked(*args, **kwargs)

    class OwnSample(GreedyAcceptance):
        def sample(self, p, generator):
            return super().sample(p, generator)

    assert engine._plain_k0(GreedyAcceptance())
    assert not engine._plain_k0(SlowVerify()) and not engine._plain_k0(OwnSample())
    calls = {"root": 0, "chain": 0}
    for name in ("root", "chain"):
        original = getattr(engine._Emitter, "emit_root" if name == "root" else "emit")

        def counted(self, *a, _original=original, _name=name, **k):
            calls[_name] += 1
            return _original(self, *a, **k)

        monkeypatch.setattr(engine._Emitter, "emit_root" if name == "root" else "emit", counted)
    ids, mask = left_padded([9, 5, 7, 3])
    outs = {}
    for rule in (GreedyAcceptance(), SlowVerify(), "greedy", "exact"):
        calls.update(root=0, chain=0)
        out = mmspec.speculative_generate(target, NullDrafter(target.config.vocab_size), ids, mask, acceptance=rule,
                                          temperature=0, max_new_tokens=30, eos_token_id=2, pad_token_id=0)
        shortcut = not isinstance(rule, SlowVerify)
        assert (calls["root"] > 0, calls["chain"] > 0) == (shortcut, not shortcut), (rule, calls)
        outs[str(rule)] = out
    first = next(iter(outs.values()))
    ref = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=30, pad_token_id=0,
                          eos_token_id=2)
    assert torch.equal(first.sequences, ref)
    for out in outs.values():
        assert torch.equal(out.sequences, first.sequences) and out.stats.new_tokens == first.stats.new_tokens


def test_unpadded_equal_length_plain_steps_run_mask_free_and_exact(target, good_drafter, monkeypatch):
    """Rows of equal length without prompt padding take the mask-free K = 0 attention path
    (`Attention.full`); greedy output still equals `generate`, alone and mixed with drafts."""
    from mmspec.drafters.null_drafter import NullDrafter
    from mmspec.ragged import RaggedKV

    full = []
    plan = RaggedKV.plan

    def spy(self, *args, **kwargs):
        att = plan(self, *args, **kwargs)
        full.append(att.full)
        return att

    monkeypatch.setattr(RaggedKV, "plan", spy)
    ids = torch.randint(3, target.config.vocab_size, (3, 7), generator=torch.Generator().manual_seed(2))
    ref = target.generate(input_ids=ids, do_sample=False, max_new_tokens=25, pad_token_id=0, eos_token_id=2)
    for drafter in (NullDrafter(target.config.vocab_size), ModelDrafter(good_drafter)):
        full.clear()
        out = mmspec.speculative_generate(target, drafter, ids, temperature=0, max_new_tokens=25, eos_token_id=2,
                                          pad_token_id=0)
        assert torch.equal(out.sequences, ref)
        assert any(full)
    # one padded row: never mask-free
    ids2, mask2 = left_padded([7, 5, 7])
    full.clear()
    out = mmspec.speculative_generate(target, NullDrafter(target.config.vocab_size), ids2, mask2, temperature=0,
                                      max_new_tokens=10, pad_token_id=0)
    ref2 = target.generate(input_ids=ids2, attention_mask=mask2, do_sample=False, max_new_tokens=10, pad_token_id=0,
                           eos_token_id=None)
    assert torch.equal(out.sequences, ref2) and not any(full)


def test_controller_and_drafter_settings_are_refused_by_name(good_drafter):
    """warmup past k_max was chosen (the drafter refused it later without naming warmup), a NaN decay
    failed as 'cannot convert float NaN to integer', decay 1.5 and prior_acceptance 3 (estimates
    above 1) were accepted; max_draft_tokens beside a tree said 'with num_draft_tokens=0 ...'."""
    for kwargs, message in [(dict(warmup=(5,)), r"warmup must hold draft lengths, ints in 0..k_max=3"),
                            (dict(warmup=(-1,)), "warmup must hold"), (dict(decay=float("nan")), "decay must be in"),
                            (dict(decay=1.5), "decay must be in"), (dict(prior_acceptance=3.0), "prior_acceptance"),
                            (dict(prior_weight=-1.0), "prior_weight")]:
        with pytest.raises(ValueError, match=message):
            DraftLengthController(3, **kwargs)
    DraftLengthController(3, warmup=(0, 3), decay=1.0, prior_acceptance=0.0, prior_weight=0.0)
    with pytest.raises(ValueError, match="max_draft_tokens=5 is for chains"):
        ModelDrafter(good_drafter, tree=mmspec.TreeConfig(depth=3, top_k=2, num_nodes="auto"), max_draft_tokens=5)
