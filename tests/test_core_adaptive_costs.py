"""Adaptive draft length: how the controller learns step costs (`mmspec/step_costs.py`,
`mmspec/adaptive.py`) from noisy wall-clock readings: outliers clipped, the machine's phase,
first readings, rarely read shapes, one-time costs, and a probe's price in a static batch. Fed
synthetic measurements, so deterministic (split from tests/test_core_adaptive.py)."""

from __future__ import annotations

import math

import pytest
import torch

from mmspec.adaptive import DraftLengthController

from test_core_adaptive import feed


def test_a_slow_outlier_step_barely_moves_the_cost_estimate_but_a_lasting_rise_comes_through():
    """Interference only slows steps down: one step timed 10x too slow moves its key's mean by at
    most (1 - decay) x 50%, not by (1 - decay) x 900%, and the machine's phase by at most
    phase_rate x log 1.15 (every estimate alike); a lasting doubling is still learnt."""
    ctrl = DraftLengthController(4)
    for _ in range(30):
        ctrl.observe(1, 2, [1], 0.002, 0.010)
    before = ctrl.seconds(1, 2)
    ctrl.observe(1, 2, [1], 0.002, 0.100)  # one 10x verify outlier
    after = ctrl.seconds(1, 2)
    assert after <= (before + 0.1 * 0.5 * 0.010) * 1.15 ** ctrl.phase_rate + 1e-12
    assert after > before  # it still counts for something
    for _ in range(30):
        ctrl.observe(1, 2, [1], 0.002, 0.020)  # the verify really got 2x slower
    assert abs(ctrl.verify.estimate((1, 3), 3) * math.exp(ctrl.log_phase) - 0.020) < 0.001


@pytest.mark.parametrize("rate", [0.1, 0.2])
def test_a_shape_read_before_the_machine_slowed_down_stays_comparable(rate):
    """Two draft lengths read alike (K = 1: verify 10 ms + draft 2 ms; K = 3: 12 + 6 ms), then
    the machine runs 1.4x slower for 40 steps while only K = 3 is read. Without a phase, K = 1's
    estimate keeps the fast machine's cost: 12 / (18 x 1.4) = 0.48 of K = 3's, where it is
    12 / 18 = 0.67. With the phase K = 1 moves with the machine, in part: the held shape's own
    mean takes up the rest (nothing tells the two apart while one shape is read), so the gap
    to the truth closes by at least a third, never past it, and the held shape reads current."""
    def run(phase_rate):
        ctrl = DraftLengthController(4, warmup=(), probe_every=0, phase_rate=phase_rate)
        for _ in range(20):
            ctrl.observe(1, 1, [1], 0.002, 0.010)
            ctrl.observe(1, 3, [3], 0.006, 0.012)
        for _ in range(40):
            ctrl.observe(1, 3, [3], 0.006 * 1.4, 0.012 * 1.4)
        return ctrl.seconds(1, 1) / ctrl.seconds(1, 3), ctrl.seconds(1, 3)

    stale, _ = run(0.0)
    assert abs(stale - 12 / 18 / 1.4) < 0.01
    ratio, now = run(rate)
    assert stale + (12 / 18 - stale) / 3 < ratio < 12 / 18 + 0.01
    assert abs(now - 0.018 * 1.4) < 0.0005
    for bad in (1.0, -0.1, "0.1", True):
        with pytest.raises(ValueError, match="phase_rate"):
            DraftLengthController(4, phase_rate=bad)


def test_acceptance_memory_counts_outcomes_so_a_small_gain_at_batch_1_is_kept():
    """Batch 1, first-draft acceptance 0.3, a slow 2-token verify shape (as oneDNN gives some
    CPUs): K = 1 loses ~25% to plain decoding, K = 2 wins ~14%. With a memory of 32 outcomes
    per position the controller speculates on most steps over 6 seeds; remembering ~10
    outcomes (decay 0.9 per step at batch 1, the planted bug: the estimate of a 30% rate often
    reads 10% and the loop falls back to plain) it stays mostly plain."""

    def verify(b, q):
        return 0.010 + (0.006 if q == 2 else 0.0) + 0.0001 * b * q

    def speculating(memory):
        steps = 0
        for seed in range(6):
            ctrl = DraftLengthController(8, memory=memory)
            feed(ctrl, 1, 600, 0.3, verify, 0.001, seed=seed)
            steps += sum(1 for k in ctrl.history[100:] if k > 0)
        return steps / (6 * 500)

    assert speculating(32) >= 0.7  # 0.81 measured (0.62 before plain stretches relaxed the estimates)
    assert speculating(10) <= 0.5  # 0.36 (0.12)


def test_the_first_steps_of_a_request_teach_only_unmeasured_costs():
    """Right after a prefill every forward is slower (cold caches): within a marked request the
    first `cold_steps` steps set a cost only where none is known, and never move a known one;
    later steps do. Unmarked use (no `begin_request`) learns from every step. (Phase off: the
    means below are then the readings' own, in seconds.)"""
    ctrl = DraftLengthController(4, warmup=(), probe_every=0, phase_rate=0.0)
    ctrl.begin_request()
    ctrl.observe(2, 0, [0, 0], 0.0, 0.030)  # cold, but the first plain cost at batch 2: kept
    ctrl.observe(2, 0, [0, 0], 0.0, 0.040)  # cold: ignored
    ctrl.observe(2, 1, [1, 0], 0.001, 0.036)  # cold, first K = 1 costs: kept
    assert ctrl.verify.means[(2, 1)] == 0.030 and ctrl.verify.means[(2, 2)] == 0.036
    assert ctrl.draft.means[(2, 1)] == 0.001
    ctrl.observe(2, 0, [0, 0], 0.0, 0.020)  # the 4th step: warm, learnt
    assert ctrl.verify.means[(2, 1)] == pytest.approx(0.9 * 0.030 + 0.1 * 0.020)
    ctrl.begin_request()
    ctrl.observe(2, 1, [1, 1], 0.005, 0.050)  # a new request's first step: cold again
    assert ctrl.verify.means[(2, 2)] == 0.036 and ctrl.draft.means[(2, 1)] == 0.001
    unmarked = DraftLengthController(4, warmup=(), probe_every=0, phase_rate=0.0)
    unmarked.observe(2, 0, [0, 0], 0.0, 0.030)
    unmarked.observe(2, 0, [0, 0], 0.0, 0.040)
    assert unmarked.verify.means[(2, 1)] == pytest.approx(0.5 * 0.030 + 0.5 * 0.040)  # two readings: their mean


def test_a_keys_first_readings_are_averaged_not_discounted():
    """A key's estimate is the plain mean of its readings until it has 1 / (1 - decay) of them,
    then a running mean. With a fixed weight of 1 - decay = 0.1 from the second reading on, a
    cheap (or dear) first reading held: after four readings of 0.044 s following one of 0.030 s
    the estimate read 0.0347 s, a shape a controller then avoided or preferred by ~20% in error."""
    from mmspec.step_costs import StepCosts

    c = StepCosts(0.9)
    readings = [0.030, 0.044, 0.044, 0.044, 0.044]
    for x in readings:
        c.observe("k", 4, x)
    assert c.means["k"] == pytest.approx(sum(readings) / len(readings))
    for _ in range(5):
        c.observe("k", 4, 0.044)
    assert c.means["k"] == pytest.approx((0.030 + 9 * 0.044) / 10)  # ten readings: still their mean
    before = c.means["k"]
    c.observe("k", 4, 0.050)
    assert c.means["k"] == pytest.approx(0.9 * before + 0.1 * 0.050)  # from then on: a running mean


def test_a_rarely_read_shape_is_weighed_against_its_row_counts_line():
    """A (rows, tokens) key read only a few times carries one step's noise, and is read again only
    when chosen or probed: its estimate is its mean weighed against the line through the other
    keys of the same row count, as two readings, until it has 1 / (1 - decay) readings of its own.
    Replayed without the models (benchmarks/auto_sim.py, session-41 tables, 28 seeds x 12 cells,
    10% step noise), runs below 0.95x the best fixed K went 25 -> 13 of 336."""
    from mmspec.step_costs import StepCosts

    c = StepCosts(0.9)
    for q, seconds in ((1, 0.010), (2, 0.012), (4, 0.016), (5, 0.018)):  # on the line 0.008 + 0.002 q
        for _ in range(20):
            c.observe((4, q), 4 * q, seconds)
    c.observe((4, 3), 12, 0.020)  # one noisy reading where the line says 0.014
    assert c.estimate((4, 3), 12) == pytest.approx((0.020 + 2 * 0.014) / 3)
    assert c.estimate((4, 2), 8) == pytest.approx(0.012)  # keys read 10 times or more: their mean
    for _ in range(9):
        c.observe((4, 3), 12, 0.020)
    assert c.estimate((4, 3), 12) == pytest.approx(0.020)  # ten readings: its own mean only
    c.observe((8, 2), 16, 0.030)  # no other key at 8 rows: nothing to weigh against
    assert c.estimate((8, 2), 16) == 0.030
    c.observe((8, 3), 24, 0.050)  # one other key: still no line (two points would be its own)
    assert c.estimate((8, 3), 24) == 0.050


def test_the_blend_keeps_a_once_seen_key_under_the_repeat_line_where_first_runs_are_dear():
    """Where first readings run dear, a key seen once is estimated at most at what the line through
    repeated readings predicts: the blend with its row count's line comes first, since that line
    may rest on once-seen (dear) keys too."""
    from mmspec.step_costs import StepCosts

    c = StepCosts(0.9)
    for q, first, again in ((1, 0.020, 0.010), (2, 0.024, 0.012)):  # first readings 2x dearer
        c.observe((4, q), 4 * q, first)
        c.observe((4, q), 4 * q, again)
    assert c.one_time_costs
    c.observe((4, 4), 16, 0.032)  # once seen, dear like every first reading here
    c.observe((4, 5), 20, 0.036)
    line = c._predict(16, repeats=True)  # through the repeated readings
    near = c._neighbours((4, 4))  # the row count's line, through dear once-seen readings as well
    assert line is not None and near > line  # (so blending after the cap would lift it above the line)
    assert c.estimate((4, 4), 16) <= line + 1e-12


def test_first_observations_are_provisional_only_where_first_runs_measure_dear():
    """A shape's first run may pay one-time costs (on CUDA: kernel selection, allocator growth) or
    not (a CPU). Measured per cost table: each key's first reading against its second. Until two
    keys show first readings >= 1.2x dearer (geometric mean), readings are averaged as usual and a
    once-seen key is taken at its reading; after that a cheaper second reading replaces the first,
    a dearer one is averaged in, and a once-seen key is estimated at most at what the line through
    repeated keys predicts."""
    from mmspec.step_costs import StepCosts

    cpu = StepCosts(0.9)  # first and second readings alike (within noise): nothing changes
    for key, tokens, first, second in (("a", 6, 0.040, 0.038), ("b", 4, 0.030, 0.031), ("d", 2, 0.025, 0.024)):
        cpu.observe(key, tokens, first)
        cpu.observe(key, tokens, second)
        assert cpu.means[key] == pytest.approx(0.5 * first + 0.5 * second)  # the mean of two readings
    assert not cpu.one_time_costs
    cpu.observe("c", 8, 0.090)
    assert cpu.estimate("c", 8) == 0.090  # a once-seen key at its reading

    c = StepCosts(0.9)
    c.observe("a", 6, 0.060)
    c.observe("a", 6, 0.038)  # 1.58x: one key's evidence is not enough
    assert not c.one_time_costs and c.means["a"] == pytest.approx(0.9 * 0.060 + 0.1 * 0.038)
    c.observe("b", 4, 0.045)
    c.observe("b", 4, 0.031)  # a second key, 1.45x: geometric mean ~1.51 > 1.2
    assert c.one_time_costs and c.means["b"] == 0.031  # replaced, not averaged
    c.observe("b", 4, 0.041)
    assert c.means["b"] == pytest.approx(2 / 3 * 0.031 + 1 / 3 * 0.041)  # later readings are averaged
    c.observe("e", 5, 0.030)
    c.observe("e", 5, 0.034)  # dearer second reading: averaged, not replaced
    assert c.means["e"] == pytest.approx(0.5 * 0.030 + 0.5 * 0.034)
    # A once-seen key at 8 tokens that cost 0.090: estimated at the repeated keys' line there.
    c.observe("c", 8, 0.090)
    fit = c.line(repeats=True)
    predicted = fit[0] + fit[1] * (8 - fit[2])
    assert predicted < 0.060 and c.estimate("c", 8) == pytest.approx(predicted)
    c.observe("c", 8, 0.050)
    assert c.estimate("c", 8) == 0.050  # seen twice: its own mean


def test_one_time_costs_of_new_shapes_do_not_pin_the_draft_length():
    """GPU-like costs (a verify costs the same at any width; 2.6 ms per drafted token) where
    every shape's first step costs 1.8x (one-time costs): the controller still settles where
    tokens per second are highest, within 2% of the best fixed K over the last 200 of 400 steps.
    (Before first observations were provisional it settled at K = 3, 8-11% off, on half the seeds.)"""
    a, verify_s, per_draft = 0.77, 0.038, 0.0026

    def per_token(k):  # seconds per emitted token at draft length k (geometric acceptance)
        return (verify_s + per_draft * k) / ((1 - a ** (k + 1)) / (1 - a))

    best = min(per_token(k) for k in range(9))
    for seed in range(4):
        ctrl, seen = DraftLengthController(8), set()
        g = torch.Generator().manual_seed(seed)
        for _ in range(400):
            k = ctrl.choose(4)
            accepted = []
            for _ in range(4):
                n = 0
                while n < k and torch.rand(1, generator=g).item() < a:
                    n += 1
                accepted.append(n)
            first = 1.8 if k not in seen else 1.0
            seen.add(k)
            ctrl.observe(4, k, accepted, first * per_draft * k, first * verify_s)
        late = ctrl.history[-200:]
        assert sum(per_token(k) for k in late) / len(late) < 1.02 * best, (seed, late[-20:])


@pytest.mark.parametrize("finish", [True, False], ids=["static-batch", "tokens-per-second"])
def test_a_probe_from_plain_is_priced_by_its_slowest_row_in_a_static_batch(finish):
    """Plain rows move in lockstep, and a static batch is done when its slowest row is: a probe
    from plain decoding bought what its slowest row gained (here 1 token: two rows accepted
    nothing), not the sum over rows. The probe budget (1% of the plain time) spaces the next probe
    by ceil(extra / (0.01 * plain step)) steps, extra = the probe's seconds less what it bought
    (with the tokens-per-second objective, every row's tokens count, as before)."""
    import math

    plain_s, verify_s, draft_per_k = 0.0133, 0.029, 0.005
    # Warm-up: two K = 1 steps (their cost known twice, so trusted) and a plain one.
    ctrl = DraftLengthController(4, warmup=(1, 1, 0), probe_every=16, max_probe_every=64, prior_acceptance=0.3)
    for i in range(40):
        k = ctrl.choose(4, [200 - i] * 4 if finish else None)
        accepted = [1, 0, 1, 0] if k else [0, 0, 0, 0]
        ctrl.observe(4, k, accepted, draft_per_k * k, verify_s if k else plain_s)
    probes = [i for i, k in enumerate(ctrl.history) if k and i >= 3]
    assert probes == [19]  # one probe (16 plain steps after the warm-up), and plain kept after it
    k = ctrl.history[19]
    probe_s = draft_per_k * k + verify_s
    bought = 1 * plain_s if finish else (4 + 2) * plain_s / 4  # slowest row: 1 token; all rows: 6 tokens
    expected_gap = math.ceil((probe_s - bought) / (0.01 * plain_s))
    assert ctrl.probe_gap == expected_gap and ctrl.next_probe == 19 + expected_gap
