"""Choosing a Jacobi window by measurement: a per-request bandit over a few window sizes.

Why not the per-step controller (mmspec/adaptive.py)? That controller ranks draft lengths K by
a myopic model: the acceptance of draft position j as measured so far, times the cost of a
(K + 1)-token verify. For a model drafter that is right: the draft at position j does not
depend on the K of earlier steps. A Jacobi window is different: the drafts at its far end are
the target's own outputs recycled from earlier iterations, and they only exist, and only get
better, for slots the window covered in the steps before. A narrow window therefore measures
low acceptance at the positions a wide window would have prepared, and the per-step model
keeps choosing narrow windows. Measured on the testbed generator (batch 1, 2-core Xeon, one
run): the per-step controller settled on 5-7 positions and ran LANTERN at 1.47x plain decoding
where a fixed window of 16 ran 1.68x, and with exact acceptance it switched speculation off
(1.00x) where a fixed window of 8 ran 1.35x.

So the window is chosen from measured throughput, not from a model of it: each candidate
window (0 = plain decoding, then 2, 4, 8, ... up to the largest window) is an arm; a request
runs one arm throughout and yields its emitted tokens per second of step time (drafting and
verification, host clock; the prefill is left out, it is the same for every arm). Switching
windows inside a request was tried and lost: after a switch to a wider window its far slots
hold no recycled drafts, and Jacobi iteration needs several steps to rebuild them, so blocks of
6 steps measured window 16 at a fifth of the rate it reaches over whole requests.

Two kinds of noise, both measured on a 2-core VM: requests differ in content (one class label
is easier to draft than another: +-15% from one request to the next), and the machine's speed
drifts (the same plain decoding ran 6.0 to 7.2 images/s from one run to the next, minutes
apart). Comparing each arm's average rate, measured whenever it last ran, let the drift decide:
an arm measured during a slow minute stayed ranked low. So rates are compared *paired*: the
arm that runs most (the best) tracks the machine's current speed, `drift` (a running mean of
its log rate, over `memory` requests), and a challenger is scored by its log rate less the
drift at the time it ran; the best arm's own score moves only when it is challenged from
below. Scores are per batch size (the request's batch at its first step); the first request
at each batch size (cold caches, first calls of its new shapes) teaches nothing. Until
session 38 only the run's first request was skipped. On an H100 a bench process that ran batch
1 and then batch 8 ran its one timed batch-8 request plainly (0.90x plain), so its warm-up had
ranked plain first; two processes that started at batch 8, whose first batch-8 request was
therefore skipped, ran window 16 at 1.13-1.14x. The recorded request was window 16 (the
warm-up's first arm) at shapes that batch size had not met: the likely cause, not confirmed
(the bandit's state was not saved). The widest window's request passes through the narrower
windows' shapes too (the window shrinks near the end of a sequence), so one skipped request
warms nearly every arm's shapes.

- Warm-up: a pass over the arms, a request each, the largest window first, then `warmup - 1`
  more passes over the arms within 2 * `margin` of the best (round robin, so that no arm is
  judged on one slow start alone); its raw rates give the first scores.
- Then the best-scored arm runs, and at most every `gap` requests one challenger runs instead:
  the most overdue arm, an arm being due when it last ran long enough ago for the expected cost
  of one request at its rate (against the best's) to stay within `budget` (3%) of the time
  spent, so an arm within a few percent is tried every `gap` requests and one at half the speed
  every ~33 (a fixed schedule tried every arm every few requests: a tree of 24 nodes at 0.57x
  plain decoding then cost 11% of a weak pair's batch-4 run that was plain otherwise). A
  challenge that leaves the best arm as it was doubles the gap (up to `max_gap`); one that
  changes it resets the gap. A challenger's new score weighs half against its old one, so one
  request can correct a stale score.
- K = 0 (plain decoding) is always an arm, so a window that cannot pay is switched off.

The choice depends on finished requests only (timings and token counts), so the loop's
verification stays exact for any window sequence. Within a request the drafter still
shortens the window near the end of the sequence.
"""

from __future__ import annotations

import math

from mmspec.recent import Recent


def candidate_windows(max_window: int) -> list[int]:
    """0 (plain), powers of two below `max_window`, and `max_window`."""
    arms, w = {0, max_window}, 2
    while w < max_window:
        arms.add(w)
        w *= 2
    return sorted(arms)


class _Batch:
    """What the bandit knows at one batch size."""

    def __init__(self):
        self.raw: dict[int, list[float]] = {}  # warm-up: arm -> [tokens, seconds]
        self.runs: dict[int, int] = {}  # arm -> requests recorded
        self.score: dict[int, float] = {}  # arm -> log rate less the drift (after the warm-up)
        self.drift = 0.0  # the best arm's recent log rate less its score
        self.last: dict[int, int] = {}  # arm -> index of its last recorded request
        self.gap = 0
        self.since = 0  # requests since the last challenge


class WindowBandit:
    """Per-request choice of a Jacobi window from paired throughput measurements (see the
    module docstring). Used by the loop through the controller interface: `choose(batch,
    remaining)` before each step (the request's arm), `observe(batch, k, accepted,
    draft_seconds, verify_seconds)` after it; the drafter calls `begin_request()` at each prefill."""

    def __init__(self, max_window: int, *, arms: list[int] | None = None, warmup: int = 2, memory: int = 4,
                 gap: int = 4, max_gap: int = 16, margin: float = 0.15, budget: float = 0.03,
                 skip_first: bool = True):
        if isinstance(max_window, bool) or not isinstance(max_window, int) or max_window < 1:
            raise ValueError(f"max_window must be an int >= 1, got {max_window!r}")
        self.arms = sorted(set(arms)) if arms is not None else candidate_windows(max_window)
        if not self.arms or any(isinstance(a, bool) or not isinstance(a, int) or not 0 <= a <= max_window
                                for a in self.arms):
            raise ValueError(f"arms must be ints in 0..{max_window}, got {arms!r}")
        for name, v, low in (("warmup", warmup, 1), ("memory", memory, 1), ("gap", gap, 1), ("max_gap", max_gap, gap)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        if not 0.0 <= float(margin) < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {margin!r}")
        if not 0.0 < float(budget) <= 1.0:
            raise ValueError(f"budget must be in (0, 1], got {budget!r}")
        self.budget = float(budget)
        self.k_max = max_window
        self.warmup, self.memory, self.base_gap, self.max_gap, self.margin = warmup, memory, gap, max_gap, float(margin)
        self.batches: dict[int, _Batch] = {}
        self.history: list[int] = Recent()  # the window chosen per step (the newest 100-200k)
        self.requests: list[tuple[int, int]] = Recent()  # (batch, arm) per request (the newest 100-200k)
        self._skip_first = skip_first
        self._warm: set[int] = set()  # batch sizes whose first (cold) request has run
        self._arm: int | None = None  # the current request's arm (None: not chosen yet)
        self._batch = 0
        self._challenge: int | None = None  # the best arm a running challenger is measured against
        self._tokens = 0
        self._seconds = 0.0

    def _state(self, batch: int) -> _Batch:
        if batch not in self.batches:
            self.batches[batch] = _Batch()
            self.batches[batch].gap = self.base_gap
        return self.batches[batch]

    # ---- estimates -------------------------------------------------------------------------
    def rate(self, batch: int, arm: int) -> float | None:
        """Emitted tokens per second of step time the arm is expected to reach now at this batch
        size (its score plus the current drift; during the warm-up its raw rate so far)."""
        st = self.batches.get(batch)
        if st is None:
            return None
        if st.score:
            return math.exp(st.score[arm] + st.drift) if arm in st.score else None
        tok, sec = st.raw.get(arm, (0.0, 0.0))
        return tok / sec if sec > 0 else None

    def warmed_up(self, batch: int) -> bool:
        """Whether the warm-up at this batch size is over (every window has a score)."""
        st = self.batches.get(batch)
        return st is not None and bool(st.score)

    def best(self, batch: int) -> int | None:
        known = {a: self.rate(batch, a) for a in self.arms}
        known = {a: r for a, r in known.items() if r is not None}
        return max(known, key=known.get) if known else None

    # ---- the controller interface ----------------------------------------------------------
    def begin_request(self) -> None:
        """Close the running request (record its rate); the next `choose` picks an arm."""
        if self._arm is not None and self._tokens > 0 and self._seconds > 0:
            if self._skip_first and self._batch not in self._warm:
                self._warm.add(self._batch)  # the first request at this batch size: cold, not recorded
            else:
                self._record(self._state(self._batch), self._arm, self._tokens, self._seconds)
        self._challenge = None
        self._arm, self._tokens, self._seconds = None, 0, 0.0

    def abort_request(self) -> None:
        """The running request raised or was stopped by its target before every row finished
        (the loop calls this once the drafter's prefill opened it): it is not scored, so partial
        requests (fewer recycled drafts in their early steps) do not bias the arms."""
        self._arm, self._tokens, self._seconds = None, 0, 0.0

    def _record(self, st: _Batch, arm: int, tokens: float, seconds: float) -> None:
        st.runs[arm] = st.runs.get(arm, 0) + 1
        st.last[arm] = len(self.requests)
        x = math.log(tokens / seconds)
        if not st.score:  # warm-up: raw sums
            raw = st.raw.setdefault(arm, [0.0, 0.0])
            raw[0] += tokens
            raw[1] += seconds
            return
        before = self.best(self._batch)
        if arm == before:  # the best arm tracks the machine's speed
            st.drift += (x - st.score[arm] - st.drift) / self.memory
        else:  # a challenger, scored against the speed of the moment
            new = x - st.drift
            st.score[arm] = new if arm not in st.score else 0.5 * (st.score[arm] + new)
        if self._challenge is not None:
            changed = self.best(self._batch) != self._challenge
            st.gap = self.base_gap if changed else min(2 * st.gap, self.max_gap)

    def _warmup_pick(self, st: _Batch) -> int | None:
        order = sorted(self.arms, reverse=True)  # the largest window first
        for arm in order:  # first pass
            if st.runs.get(arm, 0) < 1:
                return arm
        rates = {a: st.raw[a][0] / st.raw[a][1] for a in self.arms if a in st.raw and st.raw[a][1] > 0}
        top = max(rates.values()) if rates else 0.0
        for pass_ in range(1, self.warmup):  # later passes: the arms still in the running
            for arm in order:
                if st.runs.get(arm, 0) <= pass_ and rates.get(arm, 0.0) >= (1 - 2 * self.margin) * top:
                    return arm
        # warm-up done: the raw rates become the first scores (drift 0)
        st.score = {a: math.log(r) for a, r in rates.items() if r > 0}
        st.drift = 0.0
        return None

    def _pick(self, batch: int) -> int:
        st = self._state(batch)
        if not st.score:
            arm = self._warmup_pick(st)
            if arm is not None:
                return arm
            if not st.score:  # no request gave a rate (e.g. every one emitted nothing): keep the widest
                return max(self.arms)
        best = self.best(batch)
        st.since += 1
        if st.since < st.gap:
            return best
        # A challenger is due when it last ran long enough ago for its expected cost (the extra
        # time of one request at its scored rate against the best's) to stay within `budget` of
        # the time spent: an arm within 5% is tried every `gap` requests, one at half the speed
        # every 1 / budget requests. The most overdue one runs.
        now, top = len(self.requests), st.score[best]
        due = []
        for a in self.arms:
            if a == best:
                continue
            cost = max(math.exp(top - st.score.get(a, top)) - 1.0, 0.0)
            overdue = now - st.last.get(a, -1) - max(st.gap, math.ceil(cost / self.budget))
            if overdue >= 0:
                due.append((overdue, a))
        if not due:
            return best
        st.since = 0
        self._challenge = best
        return max(due)[1]

    def choose(self, batch: int, remaining: list[int] | None = None) -> int:
        if self._arm is None:  # the request's first step
            self._batch = batch
            self._arm = self._pick(batch)
            self.requests.append((batch, self._arm))
        self.history.append(self._arm)
        return self._arm

    def observe_emitted(self, emitted: list[int]) -> None:
        """The tokens each row emitted this step (the loop calls it before `observe`): what the
        arm is scored on. Accepted + 1 counted drafts the rule took past EOS / max_new_tokens, so
        wide arms looked better than they were on short requests (3-token answers: 22 counted, 8
        emitted)."""
        self._emitted = sum(emitted)

    def observe(self, batch: int, k: int, accepted: list[int], draft_seconds: float, verify_seconds: float,
                rows=None) -> None:
        emitted = self.__dict__.pop("_emitted", None)  # without the loop's count: accepted + 1 per row
        self._tokens += sum(accepted) + len(accepted) if emitted is None else emitted
        self._seconds += draft_seconds + verify_seconds

    def skip_draft_cost_once(self) -> None:  # the per-step controller's hook; nothing one-off here
        pass
