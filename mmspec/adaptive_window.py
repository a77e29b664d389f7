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
runs one arm throughout, and an arm's rate is the tokens its requests emitted per second of step
time (drafting and verification, host clock; the prefill is left out, it is the same for every
arm), as a ratio of sums over its recent requests. Switching windows inside a request was tried
and lost: after a switch to a wider window its far slots hold no recycled drafts, and Jacobi
iteration needs several steps to rebuild them, so blocks of 6 steps measured window 16 at a
fifth of the rate it reaches over whole requests. Requests differ in content (one class label
is easier to draft than another), which the ratio of sums over several requests evens out.
Rates are kept per batch size (the request's batch at its first step); the very first request
(cold caches, first calls of new shapes) teaches nothing.

- Warm-up: `warmup` passes over the arms, a request each, the largest window first (round
  robin, so that no arm is judged on one slow start alone).
- Then the arm with the best rate runs, and every `gap` requests one challenger runs instead:
  every other challenge an arm whose rate is within `margin` of the best (if any), the others
  any arm, the least recently measured first. A challenge that leaves the best arm as it was doubles the gap (up to
  `max_gap`); one that changes it resets the gap, and so does the best arm falling behind
  another by its own new requests, so a change of speed is still followed.
  Rates forget old requests (`memory` requests per arm).
- K = 0 (plain decoding) is always an arm, so a window that cannot pay is switched off.

The choice depends on finished requests only (timings and token counts), so the loop's
verification stays exact for any window sequence. Within a request the drafter still
shortens the window near the end of the sequence.
"""

from __future__ import annotations


def candidate_windows(max_window: int) -> list[int]:
    """0 (plain), powers of two below `max_window`, and `max_window`."""
    arms, w = {0, max_window}, 2
    while w < max_window:
        arms.add(w)
        w *= 2
    return sorted(arms)


class WindowBandit:
    """Per-request choice of a Jacobi window from measured throughput (see the module
    docstring). Used by the loop through the controller interface: `choose(batch, remaining)`
    before each step (the request's arm), `observe(batch, k, accepted, draft_seconds,
    verify_seconds)` after it; the drafter calls `begin_request()` at each prefill."""

    def __init__(self, max_window: int, *, arms: list[int] | None = None, warmup: int = 2, memory: int = 6,
                 gap: int = 4, max_gap: int = 32, margin: float = 0.15, skip_first: bool = True):
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
        self.k_max = max_window
        self.warmup, self.memory, self.base_gap, self.max_gap, self.margin = warmup, memory, gap, max_gap, float(margin)
        self.sums: dict[int, dict[int, list[float]]] = {}  # batch -> arm -> [tokens, seconds] (discounted)
        self.runs: dict[int, dict[int, int]] = {}  # batch -> arm -> requests recorded
        self.gaps: dict[int, int] = {}  # batch -> requests between challenges
        self.since: dict[int, int] = {}  # batch -> requests since the last challenge
        self.turn: dict[int, int] = {}  # batch -> challenges so far (whose turn it is)
        self.last_run: dict[int, dict[int, int]] = {}  # batch -> arm -> index of its last recorded request
        self.history: list[int] = []  # the window chosen for every step
        self.requests: list[tuple[int, int]] = []  # (batch, arm) of every request
        self._skip = skip_first
        self._arm: int | None = None  # the current request's arm (None: not chosen yet)
        self._batch = 0
        self._challenge: int | None = None  # the best arm a running challenger is measured against
        self._tokens = 0
        self._seconds = 0.0

    # ---- estimates -------------------------------------------------------------------------
    def rate(self, batch: int, arm: int) -> float | None:
        """Emitted tokens per second of step time over the arm's recent requests at this batch size."""
        tok, sec = self.sums.get(batch, {}).get(arm, (0.0, 0.0))
        return tok / sec if sec > 0 else None

    def best(self, batch: int) -> int | None:
        known = {a: self.rate(batch, a) for a in self.arms}
        known = {a: r for a, r in known.items() if r is not None}
        return max(known, key=known.get) if known else None

    # ---- the controller interface ----------------------------------------------------------
    def begin_request(self) -> None:
        """Close the running request (record its rate); the next `choose` picks an arm."""
        if self._arm is not None and self._tokens > 0 and self._seconds > 0:
            if self._skip:
                self._skip = False  # the first request of a run: cold, not recorded
            else:
                b, arm = self._batch, self._arm
                s = self.sums.setdefault(b, {}).setdefault(arm, [0.0, 0.0])
                keep = 1.0 - 1.0 / self.memory
                s[0] = s[0] * keep + self._tokens
                s[1] = s[1] * keep + self._seconds
                runs = self.runs.setdefault(b, {})
                runs[arm] = runs.get(arm, 0) + 1
                self.last_run.setdefault(b, {})[arm] = len(self.requests)
                if self._challenge is not None:
                    changed = self.best(b) != self._challenge
                    self.gaps[b] = self.base_gap if changed else min(2 * self.gaps.get(b, self.base_gap), self.max_gap)
                elif self.best(b) != arm and sum(runs.values()) > self.warmup * len(self.arms):
                    # the best window itself slowed down below another: speeds changed, look again soon
                    self.gaps[b] = self.base_gap
                    self.since[b] = 0
        self._challenge = None
        self._arm, self._tokens, self._seconds = None, 0, 0.0

    def _pick(self, batch: int) -> int:
        runs = self.runs.get(batch, {})
        order = sorted(self.arms, reverse=True)  # the largest window first
        for pass_ in range(self.warmup):
            for arm in order:
                if runs.get(arm, 0) <= pass_:
                    return arm
        best = self.best(batch)
        self.since[batch] = self.since.get(batch, 0) + 1
        if self.since[batch] < self.gaps.get(batch, self.base_gap):
            return best
        self.since[batch] = 0
        top = self.rate(batch, best)
        # the least recently measured first: every arm is measured again within a few challenges
        last = self.last_run.get(batch, {})
        others = sorted((a for a in self.arms if a != best), key=lambda a: last.get(a, -1))
        if not others:
            return best
        close = [a for a in others if self.rate(batch, a) >= (1 - self.margin) * top]
        turn = self.turn.get(batch, 0)
        self.turn[batch] = turn + 1
        self._challenge = best
        return close[0] if close and turn % 2 == 0 else others[0]

    def choose(self, batch: int, remaining: list[int] | None = None) -> int:
        if self._arm is None:  # the request's first step
            self._batch = batch
            self._arm = self._pick(batch)
            self.requests.append((batch, self._arm))
        self.history.append(self._arm)
        return self._arm

    def observe(self, batch: int, k: int, accepted: list[int], draft_seconds: float, verify_seconds: float,
                rows=None) -> None:
        self._tokens += sum(accepted) + len(accepted)
        self._seconds += draft_seconds + verify_seconds

    def skip_draft_cost_once(self) -> None:  # the per-step controller's hook; nothing one-off here
        pass
