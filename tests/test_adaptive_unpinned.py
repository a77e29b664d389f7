"""Documented rules of the adaptive controllers and the kernel choice that mutants of session 61
showed no test pinned. Outcomes, costs and timings are injected; nothing reads the wall clock."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

import pytest
import torch

from mmspec.adaptive import DraftLengthController
from mmspec.adaptive_window import WindowBandit
from mmspec.step_costs import StepCosts

from conftest import tiny_llama


def _probes(k_max, accept, verify, draft_tok, steps=1500):
    ctrl = DraftLengthController(k_max, probe_every=8, max_probe_every=8)
    rng = random.Random(0)
    probes, held = [], []
    for _ in range(steps):
        before = ctrl.probes
        k = ctrl.choose(1)
        (probes if ctrl.probes > before else held).append(k)
        n = 0
        while n < k and rng.random() < accept:
            n += 1
        ctrl.observe(1, k, [n], draft_tok * k, verify(k + 1))
    return probes[-40:], Counter(held[-500:]).most_common(1)[0][0]


def test_probes_alternate_around_an_interior_choice_and_try_the_other_side_at_an_end():
    probes, base = _probes(6, 0.6, lambda q: 0.010 + 0.004 * q, 0.001)
    assert 0 < base < 6
    assert sum(k < base for k in probes) >= 10 and sum(k > base for k in probes) >= 10
    probes, base = _probes(2, 0.98, lambda q: 0.010 + 0.0001 * q, 0.0002)
    assert base == 2 and all(k != 2 for k in probes)  # at k_max every probe runs below it


def test_a_plain_stretch_is_ranked_again_every_replan_every_steps():
    ctrl = DraftLengthController(8, probe_every=0)
    calls, rates = [], ctrl._rates
    ctrl._rates = lambda *a: calls.append(ctrl.steps) or rates(*a)
    rng = random.Random(0)
    for _ in range(120):
        k = ctrl.choose(1)
        n = 0
        while n < k and rng.random() < 0.02:
            n += 1
        ctrl.observe(1, k, [n], 0.002 * k, 0.010 + 0.0001 * (k + 1))
    assert ctrl.history[-1] == 0 and {b - a for a, b in zip(calls[10:], calls[11:])} == {ctrl.replan_every}


def _requests_with_row_rates(ctrl, *requests):
    for rates in requests:
        ctrl.begin_request()
        for step in range(2000):  # K = 1, each row accepting on a fixed pattern at its rate
            ctrl.observe(len(rates), 1, [1 if step % 10 < 10 * r else 0 for r in rates], 0.0, 1.0,
                         rows=list(range(len(rates))))
    ctrl.begin_request()


def test_the_spread_between_rows_is_a_sample_variance_smoothed_across_requests():
    ctrl = DraftLengthController(1)
    _requests_with_row_rates(ctrl, [0.2, 0.8])
    assert ctrl.between_var == pytest.approx(0.18, abs=1e-3)  # (0.3^2 + 0.3^2) / (2 - 1)
    ctrl = DraftLengthController(1)
    _requests_with_row_rates(ctrl, [0.2, 0.8], [0.5, 0.5])
    assert ctrl.between_var == pytest.approx(0.7 * 0.18 + 0.3 * 0.0, abs=1e-3)  # later requests weigh 0.3


def test_acceptance_forgets_at_most_by_decay_per_step():
    ctrl = DraftLengthController(1, warmup=(1,), probe_every=0)
    for _ in range(40):
        ctrl.observe(64, 1, [1] * 64, 0.0, 1.0)
    ctrl.observe(64, 1, [0] * 64, 0.0, 1.0)  # one all-rejected step of 64 rows
    assert ctrl.acceptance()[0] >= 0.85


def test_memoised_projection_costs_are_refreshed():
    ctrl = DraftLengthController(3, probe_every=4, max_probe_every=4, phase_rate=0.0)
    rng, scale = random.Random(0), 1.0
    for step in range(200):
        scale = 3.0 if step >= 40 else 1.0  # every step costs 3x from step 40 on
        k = ctrl.choose(4, [30, 20, 10, 5])
        acc = []
        for _ in range(4):
            n = 0
            while n < k and rng.random() < 0.6:
                n += 1
            acc.append(n)
        ctrl.observe(4, k, acc, scale * 0.004 * k, scale * (0.010 + 0.004 * (k + 1)))
    memo = ctrl.finish_seconds(4, 1, [30, 20, 10, 5])
    ctrl._memo.clear()
    assert ctrl.finish_seconds(4, 1, [30, 20, 10, 5]) == pytest.approx(memo, rel=0.05)


def test_more_tokens_never_cost_less():
    costs = StepCosts(0.9)
    costs.observe((1, 2), 2, 0.012)
    costs.observe((1, 4), 4, 0.010)  # noise: the wider verify read cheaper
    assert costs.line()[1] >= 0 and costs.estimate((1, 12), 12) >= costs.estimate((1, 9), 9) >= 0.010 - 1e-9


def test_a_catch_up_after_plain_steps_is_not_learnt_as_drafting_cost(target):
    from mmspec import speculative_generate
    from mmspec.drafters import ModelDrafter

    from conftest import left_padded, noisy_copy

    ids, mask = left_padded([7])
    d = ModelDrafter(noisy_copy(target, 0.02), "auto", max_draft_tokens=2)
    schedule = (0,) * 5 + (2,) * 3 + (0,) * 5 + (2,) * 3
    d.controller = DraftLengthController(2, warmup=schedule, probe_every=0)
    flagged, skip = [], d.controller.skip_draft_cost_once
    d.controller.skip_draft_cost_once = lambda: flagged.append(d.controller.steps - 1) or skip()
    readings, observe = {}, d.controller.observe

    def counting(*a, **kw):
        observe(*a, **kw)
        if d.controller.steps == len(schedule):
            readings["n"] = d.controller.draft.counts.get((1, 2))

    d.controller.observe = counting
    out = speculative_generate(target, d, ids, mask, temperature=0, max_new_tokens=3 * len(schedule) + 1)
    assert out.stats.nodes_per_step[:len(schedule)] == list(schedule)
    assert flagged == [5, 13] and readings["n"] == 4  # 6 drafting steps, the first after each plain stretch one-off


def test_an_eagle_tree_of_auto_size_opens_a_bandit_request_per_call():
    import mmspec
    from transformers import LlavaForConditionalGeneration

    from conftest import tiny_llava_config
    from mmspec.drafters import EagleHeadDrafter
    from mmspec.drafters.eagle_head import EagleHead, EagleHeadConfig
    from test_vlm_llava import IMG, V, llava_batch

    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(tiny_llava_config(V, IMG)).double().eval()
    d = EagleHeadDrafter(model, EagleHead(EagleHeadConfig.for_target(model)).double(),
                         tree=mmspec.TreeConfig(depth=2, top_k=2, num_nodes="auto"))
    ids, mask, pixels = llava_batch([(1, 2)], seed=7)
    for _ in range(6):
        mmspec.speculative_generate(model, d, ids, mask, temperature=0, max_new_tokens=6, pixel_values=pixels)
    assert len(d.controller.requests) == 6 and len({arm for _, arm in d.controller.requests}) >= 3


def test_the_most_overdue_challenger_runs_and_every_arm_keeps_running():
    rates = {0: 100.0, 2: 150.0, 4: 190.0, 8: 200.0, 16: 195.0}
    b = WindowBandit(16)
    for _ in range(400):
        b.begin_request()
        for _ in range(10):
            k = b.choose(1)
            b.observe(1, k, [1], 0.0, 2.0 / rates[k])
    late = Counter(arm for _, arm in list(b.requests)[100:])
    assert all(late[a] > 0 for a in b.arms if a != 0)  # 0 (half the best rate) may cost too much to try


def test_bandit_updates_follow_the_documented_weights():
    b = WindowBandit(16, arms=[0, 2])
    for _ in range(8):
        b.begin_request()
        for _ in range(10):
            k = b.choose(1)
            b.observe(1, k, [1], 0.0, 2.0 / 100.0)
    st = b.batches[1]
    challenger = [a for a in (0, 2) if a != b.best(1)][0]
    old = st.score[challenger]
    b._arm, b._batch, b._tokens, b._seconds, b._challenge = challenger, 1, 300, 1.0, b.best(1)
    b.begin_request()  # closes one request of the challenger at 300 tokens/s
    assert st.score[challenger] == pytest.approx(0.5 * (old + math.log(300) - st.drift))


def _model():
    return tiny_llama(layers=2, seed=6, hidden=48, dtype=torch.float32)


def test_the_kernel_choice_follows_its_documented_rules(monkeypatch):
    from mmspec.models import kernel_choice

    monkeypatch.setattr(kernel_choice, "_time", lambda fn, reps: 0.97 if "packed" in fn.__qualname__ else 1.0)
    assert kernel_choice.measure(_model(), budget_s=1e9)["policy"].describe() == "stock"  # < 5% faster: stock
    passes = {"packed": itertools.repeat(0.97), "stock": iter([1.0, 1.0, 1.0, 1.0, 3.0] * 100)}
    monkeypatch.setattr(kernel_choice, "_time", lambda fn, reps: next(passes[
        "packed" if "packed" in fn.__qualname__ else "stock"]))
    assert kernel_choice.measure(_model(), budget_s=1e9)["policy"].describe() == "stock"  # fastest pass kept
    calls = []
    monkeypatch.setattr(kernel_choice, "_time", lambda fn, reps: calls.append(1) or 1.0)
    kernel_choice.measure(_model(), budget_s=0.0)
    assert len(calls) == 2 * 2 * len(kernel_choice.ROWS)  # two passes each, whatever the budget
    monkeypatch.setattr(kernel_choice, "PASS_BYTES", 1)
    assert kernel_choice.measure(_model(), budget_s=1e9)["layers_timed"] == 1
    monkeypatch.undo()
    model = _model()
    monkeypatch.setattr(kernel_choice, "_time", lambda fn, reps: 0.5 if "packed" in fn.__qualname__ else 1.0)
    kernel_choice.measure(model, rows=(1, 2))
    monkeypatch.setattr(kernel_choice, "_time", lambda fn, reps: 2.0 if "packed" in fn.__qualname__ else 1.0)
    again = kernel_choice.measure(model, rows=(1, 8, 32))  # other row counts: measured again
    assert tuple(again["rows"]) == (1, 8, 32) and again["policy"].describe() == "stock"


def test_the_bandit_drift_is_a_running_mean_over_memory_requests():
    rates = {0: 100.0, 2: 110.0, 4: 150.0, 8: 175.0, 16: 172.0}

    def request(b, rate_of):
        b.begin_request()
        for _ in range(10):
            k = b.choose(1)
            b.observe(1, k, [1], 0.0, 2.0 / rate_of(k))
        return b.requests[-1][1]

    b = WindowBandit(16)
    for _ in range(40):
        request(b, rates.get)
    st, best = b.batches[1], b.best(1)
    while True:  # one request of the best arm at twice its rate (challengers in between change no drift)
        drift = st.drift
        if request(b, lambda k: 2 * rates[k] if k == best else rates[k]) == best:
            break
    b.begin_request()  # close it
    assert st.drift - drift == pytest.approx(math.log(2) / b.memory, rel=0.05)


def test_the_kernel_timing_budget_is_shared_by_the_row_counts(monkeypatch):
    from mmspec.models import kernel_choice

    calls = []
    monkeypatch.setattr(kernel_choice, "_time", lambda fn, reps: calls.append(1) or 1.0)
    clock = itertools.count(0.0, 0.1)  # every clock read advances 100 ms
    monkeypatch.setattr(kernel_choice.time, "perf_counter", lambda: next(clock))
    kernel_choice.measure(_model(), budget_s=0.5)
    assert len(calls) // 2 == 3 + 2 * (len(kernel_choice.ROWS) - 1)  # the first row count spends it; 2 passes after
