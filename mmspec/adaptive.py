"""Adaptive draft length: pick, before every step, the number of draft tokens K (0..K_max)
that maximises the expected tokens per second of the current batch, from past steps only.

Model (per step, B active rows, K drafts per row):

    E[tokens per row](K) = 1 + sum_{i=1..K} prod_{j=1..i} a_j            (a_j: P(draft j accepted | j-1 accepted))
    seconds(B, K)        = verify(B, K + 1) + draft(B, K)
    choose K = argmax_K  B * E(K) / seconds(B, K)

- On a batch the loop also passes each row's remaining token budget, and K minimises the
  projected time until the *last* row is done instead: speculation lets rows drift apart
  (each accepts its own run), so a static batch waits for its unluckiest row, while plain
  steps keep every row in step. A row needing r tokens takes ~ r / E[G] + E[G(G-1)] / (2 E[G]^2)
  steps (the second term: the last step's drafts past the budget, wasted; K past the last
  row's r - 1 buys nothing) with sd sqrt(r Var[G] / E[G]^3) (G: tokens per step), and the
  last of B rows lags by ~ E[max of B standard normals] of those sd (`finish_seconds`;
  within 8% of a simulated batch, tests/test_core_adaptive_batch.py).
  Rows also differ in acceptance (one prompt is easier to draft than another), which widens the
  gap to the slowest row beyond that step-to-step noise: the controller counts each row's
  accepted and judged drafts during a request (the loop passes row ids) and, when the next
  request begins, folds the variance of the per-row rates, less binomial noise, into
  `between_var`; the projection adds the steps a row sigma_a below the mean rate needs
  (measured on the 47% bench pair at batch 4: the slowest row took 39 steps at K = 1 where
  independent rows project 37).
  Rows that are done leave the batch: between two rows' expected finishes a step costs what a
  step of the rows still running costs (measured per row count, or from the fitted lines).
  docs/adaptive.md gives the history of this projection and what each version measured.
  At batch 1 the ranking is that of tokens per second, less the last step's overshoot.
- `a_j` are running estimates with forgetting (recent outcomes weigh more), so speculation
  switches itself off when acceptance drops and back on when it recovers. They forget per draft
  outcome (a memory of `memory` = 32 outcomes per position) and at most by `decay` per step:
  per-step forgetting alone remembered ~10 outcomes at batch 1, too few to tell a 30% first-draft
  acceptance (where K = 2 paid 14% on one CPU) from 10% (where it does not). Positions never
  tried borrow the pooled rate of the tried ones (a geometric tail). A plain step judges no
  draft, so while plain the recent rates relax upward toward long-run ones (512 outcomes per
  position, ~30 steps): a run of rejections (or noise) that switched speculation off would
  otherwise hold until a probe, and one probe judges one step's drafts (replayed without the
  models: benchmarks/auto_sim.py, docs/adaptive.md).
- `verify(B, Q)` and `draft(B, K)` are measured: per-(B, Q) running means where observed (the
  plain mean of a key's first 1 / (1 - decay) readings, so a second reading counts half, except a
  much cheaper second reading while one-time costs are undecided: see `mmspec/step_costs.py`; an
  observation above 1.5x its key's mean counts as 1.5x: interference only slows steps down),
  otherwise a least-squares line in the number of tokens processed (B * Q for verify, B * K for
  drafting) fitted to every observation so far, so a batch size seen for the first time still gets
  an estimate. A key read fewer than 1 / (1 - decay) times is weighed against the line through the
  other keys of its row count (as two readings): it is read again only when chosen or probed, so
  one noisy reading would otherwise steer rankings for long. K = 0 is plain decoding (no drafting).
- The machine's speed moves in phases that every shape shares (a shared VM ran 45% faster for
  minutes while `auto` held one K, and the shapes read before kept their old costs). A log phase
  follows it: each warm verify of a shape read before moves it by `phase_rate` (0.1) x its log
  ratio to that shape's estimate, clipped to +-15% (one interference spike moves every estimate
  by at most ~1.4%); costs are kept in the units of phase 0 and estimates scaled by the phase.
- Switching speculation on must pay by a margin (`min_gain`, 4% by default): K > 0 is chosen
  over K = 0 only when its estimated rate beats plain decoding's by that much. Batched
  speculation has costs a per-step model does not see (rows drift apart, so later steps lose
  the equal-length fast path and the batch thins out unevenly), and near-ties are where
  estimation noise decides; the margin keeps those steps plain.
- Exploration is deterministic: a short warm-up over a few K values, then probes of the
  neighbour of the current choice (from plain decoding: the best K > 0 by the estimates, as
  K = 1 can lose where K = 2 wins), so the estimates stay fresh. The first probe comes
  `probe_every` steps after the warm-up; a probe after which the choice stays what it was
  doubles the gap to the next one (up to `max_probe_every`), a probe that changes it resets
  the gap. A pair whose speculation never pays thus stops paying for probes (each one makes
  the drafter catch up on every token since it last ran), while a change in acceptance is
  still found within a few `max_probe_every` steps. A probe that changes nothing also spaces
  the next one so that probing takes at most `probe_budget` (1%) of the time of plain steps
  (its measured seconds less what its tokens were worth at the kept choice; at most
  `budget_gap_factor * max_probe_every` = 1024 steps, so recovery stays bounded). The
  controller lives on the drafter, so the gaps carry over from one call to the next.
  Where the loop marks the controller `shadow_capable` (a `ModelDrafter` chain, greedy, a
  lossless rule), a probe from plain decoding stays plain and asks the drafter to catch up with
  logits at every token of the plain stretch: its greedy agreements with what the target emitted
  are the outcomes chains started there would have had (`observe_shadow`,
  mmspec/shadow_acceptance.py), dozens of draft outcomes per row for the catch-up's cost, with
  no verify of drafts and no rows left at different lengths.
- The first `cold_steps` (3) steps of a request (the loop marks requests with `begin_request`)
  teach only costs not measured yet: right after a prefill every forward runs slower (cold
  caches), and `auto` takes its plain steps mostly there, so their costs made plain decoding
  look ~8% dearer than a whole plain request measures (69% bench pair, batch 16).
- Steps whose drafting included one-off work (the drafter catching up after plain steps,
  or its deferred prompt prefill; the drafter reports it through `skip_draft_cost_once`)
  teach the acceptance and verify estimates but not the per-step drafting cost, which
  would otherwise count a one-time cost as the steady-state price of speculating.

Because K depends only on finished steps, the output distribution is untouched: each step
verifies its draft exactly, whatever K was (greedy output is identical for every K).

Related schedules, for orientation (ours differs in being cost-model driven and batch-aware):
transformers' assisted generation grows K by 2 after a fully accepted draft and shrinks it by
1 otherwise (`num_assistant_tokens_schedule="heuristic"`); SpecDec++ (Huang et al. 2024,
arXiv 2405.19715) stops drafting when a learned acceptance predictor falls below a threshold;
DISCO (Mamou et al. 2024, arXiv 2405.04304) trains a classifier for the same stop decision;
BanditSpec (Hou et al. 2025, arXiv 2505.15141) treats the choice of K as a bandit problem.
"""

from __future__ import annotations

import math
from collections import defaultdict

from mmspec.recent import Recent
from mmspec.shadow_acceptance import chain_counts
from mmspec.step_costs import StepCosts


_SQRT2, _SQRT2PI = math.sqrt(2.0), math.sqrt(2.0 * math.pi)


class DraftLengthController:
    """Chooses K per step for a chain drafter with at most `k_max` drafts."""

    # A probe that costs more than the probe budget allows at max_probe_every is spaced out
    # to honour the budget, up to this many times max_probe_every.
    budget_gap_factor = 16
    # The machine's speed moves in phases that every shape shares (`observe`): each warm verify
    # of a shape read before moves the log phase by `phase_rate` x its log ratio to the shape's
    # estimate, clipped to +-`phase_band` so that one interference spike moves every estimate by
    # at most ~1.4%. Replayed without the models (benchmarks/auto_sim.py, 336 runs a setting):
    # runs below 0.95x K* without phases 13 -> 15, with sd 15% / 100 steps 55 -> 40, sd 30% /
    # 200 steps 74 -> 45 (docs/adaptive.md). `phase_rate=0` in the
    # constructor turns it off.
    phase_rate = 0.1
    phase_band = math.log(1.15)

    def __init__(
        self,
        k_max: int,
        *,
        prior_acceptance: float = 0.7,
        prior_weight: float = 2.0,
        decay: float = 0.9,
        memory: int = 32,
        warmup: tuple[int, ...] | None = None,
        probe_every: int = 16,
        max_probe_every: int = 64,
        probe_budget: float = 0.01,
        min_gain: float = 0.04,
        phase_rate: float | None = None,
    ):
        if not isinstance(k_max, int) or k_max < 0:
            raise ValueError(f"k_max must be an int >= 0, got {k_max!r}")
        self.k_max = k_max
        # (each checked by name: a NaN decay failed deep inside as "cannot convert float NaN to
        # integer", a prior_acceptance of 3 made acceptance estimates above 1)
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1] (the weight a past step keeps per step), got {decay!r}")
        if isinstance(prior_acceptance, bool) or not isinstance(prior_acceptance, (int, float)) or not (
                0.0 <= prior_acceptance <= 1.0):
            raise ValueError(f"prior_acceptance must be a probability in [0, 1], got {prior_acceptance!r}")
        if isinstance(prior_weight, bool) or not isinstance(prior_weight, (int, float)) or not (
                0.0 <= prior_weight < math.inf):
            raise ValueError(f"prior_weight must be a finite number >= 0, got {prior_weight!r}")
        self.decay = decay
        if not isinstance(memory, int) or memory < 2:
            raise ValueError(f"memory must be an int >= 2 (draft outcomes remembered per position), got {memory!r}")
        self.memory = memory
        # Conditional acceptance per position, as discounted counts (accepted, tried).
        self.acc = [prior_acceptance * prior_weight] * k_max
        self.tried = [prior_weight] * k_max
        # The same counts with a long memory (`long_memory` outcomes per position): what a plain
        # stretch relaxes the recent estimates toward (see `observe`).
        self.long_memory = 512
        self.acc_long = [0.0] * k_max
        self.tried_long = [0.0] * k_max
        self.relax = 0.97  # per plain step
        # The machine's phase (see `observe`): costs are kept in its units, estimates scaled by it.
        rate = type(self).phase_rate if phase_rate is None else phase_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate < 1.0:
            raise ValueError(f"phase_rate must be in [0, 1) (0: no phase), got {phase_rate!r}")
        self.phase_rate = float(rate)
        self.log_phase = 0.0
        self.verify = StepCosts(decay)
        self.draft = StepCosts(decay)
        k0 = min(3, k_max)  # two draft lengths give the cost lines two points; the rest is chosen
        self.warmup = list(warmup if warmup is not None else (k0, min(1, k_max), k0))
        if any(isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= k_max for k in self.warmup):
            raise ValueError(f"warmup must hold draft lengths, ints in 0..k_max={k_max}, got {warmup!r}")
        if not isinstance(probe_every, int) or probe_every < 0:
            raise ValueError(f"probe_every must be an int >= 0 (0: never probe), got {probe_every!r}")
        if not isinstance(max_probe_every, int) or max_probe_every < probe_every:
            raise ValueError(f"max_probe_every must be an int >= probe_every={probe_every}, got {max_probe_every!r}")
        if not 0.0 < float(probe_budget) <= 1.0:
            raise ValueError(f"probe_budget must be in (0, 1], got {probe_budget!r}")
        self.probe_every = probe_every
        self.max_probe_every = max_probe_every
        self.probe_budget = float(probe_budget)
        self._probe_seconds: float | None = None  # what the last probe step took
        self._probe_tokens = 0  # and the tokens it emitted (what they are worth: see `observe`)
        self._finish_objective = False  # the last `choose` ranked by time to finish the batch
        self.probe_gap = probe_every  # steps from one probe to the next (grows while probes change nothing)
        self.next_probe = len(self.warmup) + probe_every if probe_every else None
        self.probes = 0
        self._probe_base: int | None = None  # the choice a pending probe deviated from
        self._probe_unobserved = False  # (a probe chosen, its step not observed yet)
        self._skip_draft_cost = False
        # Shadow probes (mmspec/shadow_acceptance.py): the loop sets `shadow_capable` where the
        # drafter can read greedy acceptance off a plain stretch (ModelDrafter, greedy, lossless
        # rule); a probe from plain decoding then stays plain and asks the drafter for it.
        self.shadow_capable = False
        self._shadow_due = False
        self._shadow_rows: list[tuple[int, int]] | None = None
        if not 0.0 <= float(min_gain) < 1.0:
            raise ValueError(f"min_gain must be in [0, 1), got {min_gain!r}")
        self.min_gain = float(min_gain)
        self.steps = 0
        self.history: list[int] = Recent()  # the K chosen per step (the newest 100-200k steps)
        # How much rows differ in acceptance (variance of the per-row rate), learned request by
        # request from per-row counts (`begin_request`); 0 until measured: rows as independent draws.
        self.between_var = 0.0
        self.between_requests = 0
        self._row_counts: dict = {}  # row id -> [accepted drafts, tried drafts] in the current request
        self._req_step: int | None = None  # steps observed in this request (None: requests are not marked)
        self.cold_steps = 3  # a request's first steps teach the costs only of shapes not measured yet
        self.last_choice = k0
        self.replan_every = 4  # while plain: steps between rankings (see `choose`)
        self._plain_age = 0
        self._plain_batch: int | None = None
        # seconds(b, K) for the projection's stretches, kept between rankings: a step changes its
        # own key's means, and the fitted lines (forgetting 1% a reading) only slowly
        self._memo: dict = {}
        self._memo_age = 0

    # ---- estimates ------------------------------------------------------------------------------
    def acceptance(self) -> list[float]:
        return [a / t if t > 0 else 0.0 for a, t in zip(self.acc, self.tried)]

    def expected_tokens(self, k: int) -> float:
        rates = self.acceptance()
        total, run = 1.0, 1.0
        for i in range(k):
            run *= rates[i]
            total += run
        return total

    def seconds(self, batch: int, k: int) -> float | None:
        """Estimated seconds of a step of `batch` rows at K, at the machine's current phase."""
        s = self._unit_seconds(batch, k)
        return None if s is None else s * math.exp(self.log_phase)

    def _unit_seconds(self, batch: int, k: int) -> float | None:
        """`seconds` in the units the costs are kept in (phase 0): what rankings compare."""
        v = self.verify.estimate((batch, k + 1), batch * (k + 1))
        d = 0.0 if k == 0 else self.draft.estimate((batch, k), batch * k)
        if v is None or d is None:
            return None
        return v + d

    def rate(self, batch: int, k: int) -> float | None:
        s = self.seconds(batch, k)
        return None if s is None or s <= 0 else batch * self.expected_tokens(k) / s

    def token_moments(self, k: int, rates: list[float] | None = None) -> tuple[float, float]:
        """Mean and variance of the tokens one row emits in a step at K (bonus included):
        G = 1 + #accepted, P(G > i) = a_1 ... a_i (`rates`: `acceptance()`, if already at hand)."""
        rates = self.acceptance() if rates is None else rates
        mean, square, run = 1.0, 1.0, 1.0
        for i in range(k):
            run *= rates[i]
            mean += run
            square += (2 * i + 3) * run  # E[G^2] = sum_i (2i + 1) P(G > i)
        return mean, max(square - mean * mean, 0.0)

    def _all_moments(self, rates: list[float]) -> list[tuple[float, float]]:
        """`token_moments(k, rates)` for k = 0..k_max in one pass (the same sums, accumulated)."""
        out = [(1.0, 0.0)]
        mean, square, run = 1.0, 1.0, 1.0
        for i in range(self.k_max):
            run *= rates[i]
            mean += run
            square += (2 * i + 3) * run
            out.append((mean, max(square - mean * mean, 0.0)))
        return out

    @staticmethod
    def _mean_slopes(rates: list[float], k_max: int) -> list[float]:
        """d E[G](K) / d delta for K = 0..k_max when every position's rate moves by delta (how
        much a row's tokens per step follow its own acceptance): with P_i = a_1 ... a_i,
        E[G] = 1 + sum_i P_i and dP_i = dP_(i-1) a_i + P_(i-1)."""
        out, p, dp, total = [0.0], 1.0, 0.0, 0.0
        for i in range(k_max):
            dp = dp * rates[i] + p
            p *= rates[i]
            total += dp
            out.append(total)
        return out

    def finish_seconds(self, batch: int, k: int, remaining: list[int]) -> float | None:
        """Projected seconds until the batch's last row is done if every step drafted K.
        A row that needs r more tokens takes about r / E[G] + E[G(G-1)] / (2 E[G]^2) steps
        (renewal theory: the second term is the last step's overshoot past the budget; sd
        sqrt(r Var[G] / E[G]^3)); the last row to finish is the maximum of the rows' normal
        finishing steps (Clark's moments, folded in from the slowest row down). At K = 0 every
        row takes exactly r steps, and no K takes more (at least one token per step); K past the
        slowest row's r - 1 counts as r - 1. Rows that are done leave the batch, so between two
        rows' expected finishes a step costs `seconds(rows still running, K)`, summed over those
        stretches; at batch 1, seconds(1, K) times the expected steps."""
        t = self._finish_seconds(batch, k, remaining, self.acceptance())
        return None if t is None else t * math.exp(self.log_phase)

    def _finish_seconds(self, batch: int, k: int, remaining: list[int], rates: list[float],
                        moments: tuple[float, float] | None = None, slope: float | None = None) -> float | None:
        """`finish_seconds` with what a caller ranking every K computes once for all K: the
        `moments` of K and the `slope` of E[G] in the rates (`_mean_slopes`); in phase units."""
        s = self._seconds_memo(batch, k)
        if s is None or s <= 0:
            return None
        ordered = sorted(remaining)
        r = ordered[-1]
        kk = min(k, max(r - 1, 0))  # drafts past the slowest row's budget are never emitted
        mean, var = self.token_moments(kk, rates) if moments is None else moments
        # Rows differ in acceptance (prompt by prompt): a row sigma_m below the mean tokens per step
        # needs r sigma_m / mean^2 more steps, on top of the step-to-step noise r Var[G] / mean^3.
        between = 0.0
        if self.between_var > 0.0 and k > 0:
            slope = self._mean_slopes(rates, kk)[kk] if slope is None else slope
            between = (r * math.sqrt(self.between_var) * slope / mean ** 2) ** 2
        # A request ends mid-step: the last step's drafts past the budget are wasted, so a row
        # needing r tokens takes about r / mean + E[G(G - 1)] / (2 mean^2) steps (renewal theory:
        # the mean overshoot past the budget; 0 at K = 0, within 0.05 step of the exact
        # expectation from r = K + 2 on), and at least one.
        overshoot = (var + mean * mean - mean) / (2.0 * mean * mean)
        noise, spread = var / mean ** 3, between / max(r * r, 1)  # step variance: r * noise + r^2 * spread
        # The last row to finish: Clark's moments of the maximum of normal finishing steps, folded
        # in from the slowest row down (rows far enough below it no longer matter).
        finish = [ri / mean + overshoot for ri in ordered]  # each row's expected steps
        m, v = finish[-1], r * noise + between
        for ri, mi in zip(reversed(ordered[:-1]), reversed(finish[:-1])):
            vi = ri * noise + ri * ri * spread
            theta = math.sqrt(v + vi)
            if theta <= 0.0:
                m = max(m, mi)
                continue
            z = (m - mi) / theta
            if z > 4.0:  # this row and all below it finish first (P > 0.99997)
                break
            cdf, pdf = 0.5 * (1.0 + math.erf(z / _SQRT2)), math.exp(-0.5 * z * z) / _SQRT2PI
            second = (m * m + v) * cdf + (mi * mi + vi) * (1.0 - cdf) + (m + mi) * theta * pdf
            m = m * cdf + mi * (1.0 - cdf) + theta * pdf
            v = max(second - m * m, 0.0)
        steps = min(max(m, 1.0), r)
        if batch == 1:
            return s * steps
        # Rows that are done leave the batch: a row is done after its own r_i / mean + overshoot
        # steps (the slowest after `steps`); in between, a step costs what the rows left cost.
        total, prev, b = 0.0, 0.0, batch
        for f in sorted([min(max(f, 1.0), ri) for f, ri in zip(finish[:-1], ordered)] + [steps]):
            if f > prev:  # rows with the same budget finish together: no stretch between them
                sb = s if b == batch else self._seconds_memo(b, k)
                total += (f - prev) * (sb if sb is not None else s * b / batch)
                prev = f
            b -= 1
        return total

    # ---- the decision ---------------------------------------------------------------------------
    def choose(self, batch: int, remaining: list[int] | None = None) -> int:
        """K for the next step of `batch` rows; `remaining` (host ints, one per row: tokens the
        row may still emit) switches the objective from tokens per second to the time until
        the whole batch is done (see `finish_seconds`)."""
        if remaining is not None and len(remaining) != batch:
            raise ValueError(f"remaining must hold one count per row ({batch}), got {len(remaining)}")
        self._finish_objective = remaining is not None
        if self.k_max == 0:
            k = 0
        elif self.steps < len(self.warmup):
            k = self.warmup[self.steps]
        elif (self.last_choice == 0 and self._probe_base is None and batch == self._plain_batch
              and self._plain_age < self.replan_every - 1 and (self.next_probe is None or self.steps < self.next_probe)):
            # Plain decoding, no probe due: only K = 0's cost moved since the last ranking, so
            # re-rank every `replan_every` steps (a ranking costs ~70 us on a 2-core VM: 3% of a
            # testbed image-GPT step, paid on every plain step before).
            self._plain_age += 1
            k = 0
        else:
            self._plain_age, self._plain_batch = 0, batch
            rates = self._rates(batch, remaining)
            k = self._best(rates)
            if self._probe_base is not None:  # the step after a probe: did it change the choice?
                changed = k != self._probe_base
                self.probe_gap = self.probe_every if changed else min(2 * self.probe_gap, self.max_probe_every)
                plain, base = self.seconds(batch, 0), self.seconds(batch, k)
                if not changed and plain and base is not None and self._probe_seconds is not None:
                    # What the probe cost over the kept choice for the tokens it emitted (a
                    # probe that drafts also emits more: at K = 0, a plain step per token).
                    per_token = base / (batch * self.expected_tokens(k))
                    extra = max(self._probe_seconds - self._probe_tokens * per_token, 0.0)
                    need = math.ceil(extra / (self.probe_budget * plain))
                    self.probe_gap = max(self.probe_gap, min(need, self.budget_gap_factor * self.max_probe_every))
                self.next_probe = self.steps - 1 + self.probe_gap  # counted from the probe
                self._probe_base = None
            if self.next_probe is not None and self.steps >= self.next_probe:
                # Keep the neighbours' estimates fresh: alternate above / below the choice. From
                # plain decoding, probe the best draft length by the estimates (K = 1 may lose
                # where K = 2 wins: at batch 1 a 3-token verify can cost what a 1-token one does).
                self._probe_base = k
                if k == 0 and self.shadow_capable:
                    self._shadow_due = True  # a plain step whose drafter catch-up measures acceptance
                else:
                    k = self._probe_choice(k, rates)
                self.probes, self._probe_unobserved = self.probes + 1, True
        self.last_choice = k
        self.history.append(k)
        self.steps += 1
        return k

    def _probe_choice(self, k: int, rates: dict[int, float | None]) -> int:
        """The K a probe tries instead of the choice `k`."""
        if k == 0:
            return self._best_drafting(rates)
        step = 1 if self.probes % 2 else -1
        probe = min(max(k + step, 0), self.k_max)
        if probe == k:  # at an end of 0..k_max: try the other side
            probe = min(max(k - step, 0), self.k_max)
        return probe

    @staticmethod
    def _best_drafting(rates: dict[int, float | None]) -> int:
        """The K > 0 the estimates (`_rates`) rank first (1 when nothing is known yet)."""
        known = {k: r for k, r in rates.items() if k > 0 and r is not None}
        return max(known, key=known.get) if known else 1

    def _rates(self, batch: int, remaining: list[int] | None) -> dict[int, float | None]:
        if remaining:
            # Rate = inverse projected time (only the ranking matters).
            acc = self.acceptance()  # once per step, not once per K
            moments = self._all_moments(acc)  # one pass for every K (token_moments is O(K) each)
            slopes = self._mean_slopes(acc, self.k_max)
            # Drafts past a row's budget are never emitted: K beyond the slowest row's r - 1
            # tokens buys what K = r - 1 does, at its own cost.
            cap = max(max(remaining) - 1, 0)
            times = {k: self._finish_seconds(batch, k, remaining, acc, moments[min(k, cap)], slopes[min(k, cap)])
                     for k in range(self.k_max + 1)}
            scale = math.exp(self.log_phase)  # times in the costs' units: rates at the current phase
            return {k: None if t is None else 1.0 / (t * scale) for k, t in times.items()}
        return {k: self.rate(batch, k) for k in range(self.k_max + 1)}

    def _best(self, rates: dict[int, float | None]) -> int:
        known = {k: r for k, r in rates.items() if r is not None}
        k = max(known, key=known.get) if known else self.last_choice
        if k > 0 and known.get(0) is not None and known[k] < (1.0 + self.min_gain) * known[0]:
            k = 0  # speculation must pay by the margin
        return k

    def begin_request(self) -> None:
        """A new request starts (the loop calls this once per call): fold the last request's
        per-row acceptance into `between_var` and count afresh."""
        est = self._row_spread()
        if est is not None:
            self.between_var = est if self.between_requests == 0 else 0.7 * self.between_var + 0.3 * est
            self.between_requests += 1
        self._row_counts = {}
        self._req_step = 0
        self._plain_batch = None  # rank afresh: the last request's final plain steps say nothing of this one
        # A step that raised between `choose` and `observe` (`steps` / `history` still count it):
        # its probe is taken back (the next step probes again), its one-off drafting flag void.
        self._shadow_due, self._shadow_rows, self._skip_draft_cost = False, None, False
        if self._probe_unobserved:
            self._probe_base, self._probe_unobserved, self.probes = None, False, self.probes - 1

    def _row_spread(self, min_tried: int = 4) -> float | None:
        """Method of moments over the rows of one request: the variance of the per-row acceptance
        rates less what binomial noise alone gives at each row's number of judged drafts
        (clamped at 0); None with fewer than two rows that judged `min_tried` drafts."""
        rows = [(a, t) for a, t in self._row_counts.values() if t >= min_tried]
        if len(rows) < 2:
            return None
        p = sum(a for a, _ in rows) / sum(t for _, t in rows)
        observed = sum((a / t - p) ** 2 for a, t in rows) / (len(rows) - 1)
        noise = sum(p * (1 - p) / t for _, t in rows) / len(rows)
        return max(observed - noise, 0.0)

    def take_shadow(self) -> bool:
        """Whether this plain step is a shadow probe (the drafter asks once, in its propose)."""
        due, self._shadow_due = self._shadow_due, False
        return due

    def observe_shadow(self, hits: list[list[bool]]) -> None:
        """Learn acceptance from a plain stretch: `hits[b][j]` whether the drafter's greedy
        prediction after row b's j-th stretch token was the token the target emitted next
        (`chain_counts`). Counts enter as a step's draft outcomes would; the per-row first-draft
        counts join the row's acceptance counts at the step's `observe` (which knows row ids)."""
        tried, accepted, per_row = chain_counts(hits, self.k_max)
        self._shadow_rows = per_row
        self._count_outcomes(tried, accepted)

    def _count_outcomes(self, tried: list[int], accepted: list[int]) -> None:
        """Fold (tried, accepted) counts per position into the recent and long-run estimates."""
        rate = 1.0 - 1.0 / self.memory
        long_rate = 1.0 - 1.0 / self.long_memory
        for i, (t, ok) in enumerate(zip(tried, accepted)):
            if t:
                d = max(rate ** t, self.decay)
                self.acc[i] = d * self.acc[i] + ok
                self.tried[i] = d * self.tried[i] + t
                d = long_rate ** t
                self.acc_long[i] = d * self.acc_long[i] + ok
                self.tried_long[i] = d * self.tried_long[i] + t

    def skip_draft_cost_once(self) -> None:
        """The current step's drafting includes one-off work (a catch-up after plain steps,
        a deferred prefill): its seconds are not the per-step cost of drafting."""
        self._skip_draft_cost = True

    def observe(self, batch: int, k: int, accepted: list[int], draft_seconds: float, verify_seconds: float,
                rows: list[int] | None = None) -> None:
        """Learn from a finished step: per-row accepted drafts (by the rule, before any EOS cut);
        `rows`: an id per row, stable within a request (the loop passes each row's input index),
        for the per-row acceptance counts behind `between_var`."""
        if rows is not None and k > 0 and len(rows) == len(accepted):
            counts = self._row_counts
            for rid, n in zip(rows, accepted):
                c = counts.get(rid)
                if c is None:
                    c = counts[rid] = [0, 0]
                c[0] += min(n, k)
                c[1] += min(n + 1, k)  # drafts judged: the accepted ones and the first rejected one
        if self._probe_base is not None:
            self._probe_seconds = draft_seconds + verify_seconds
            gained = [1 + min(n, k) for n in accepted]
            if self._probe_base == 0 and self._finish_objective and gained:
                # A probe from plain decoding in a batch that is done when its slowest row is:
                # plain rows move in lockstep, so the probe bought what its slowest row gained, for
                # every row (counting every row's gain priced a K = 1 probe at batch 4, 47%
                # acceptance, ~1.5 plain steps cheaper than it ran: probes every ~50 steps, not ~150).
                self._probe_tokens = batch * min(gained)
            else:
                self._probe_tokens = sum(gained)
        # Acceptance forgets per draft outcome, and at most by `decay` per step: a position
        # remembers about `memory` outcomes at small batches (decay 0.9 per step alone was ~10
        # outcomes at batch 1, too few to tell a 28% first-draft acceptance from 10%) and
        # about 1 / (1 - decay) steps at large ones.
        self._count_outcomes([sum(1 for n in accepted if n >= i) for i in range(k)],  # rows that reached draft i
                             [sum(1 for n in accepted if n > i) for i in range(k)])
        if self._shadow_rows is not None:  # this step's shadow probe: per-row first-draft counts
            if rows is not None and len(rows) == len(self._shadow_rows):
                for rid, (ok, judged) in zip(rows, self._shadow_rows):
                    c = self._row_counts.setdefault(rid, [0, 0])
                    c[0] += ok
                    c[1] += judged
            self._shadow_rows = None
        if k == 0:
            # A plain step judges no draft, so the recent rates would stay where they were when
            # speculation was switched off: a run of hard tokens (or noise) that made plain look
            # better would hold until a probe, and a probe judges one step's drafts. Instead they
            # relax toward the long-run rates (a ~30-step time constant): what is known of this
            # pair when nothing recent is.
            # Only upward: a recent rate above the long-run one (acceptance that recovered, seen
            # by a probe) is what the next probes must confirm, not what a plain stretch undoes.
            for i in range(self.k_max):
                if self.tried_long[i] > 0 and self.acc_long[i] * self.tried[i] > self.acc[i] * self.tried_long[i]:
                    target = self.acc_long[i] / self.tried_long[i]
                    self.acc[i] = self.relax * self.acc[i] + (1 - self.relax) * target * self.tried[i]
        if k > 0:
            # Untried positions drift toward the pooled rate of the tried ones.
            pooled = sum(self.acc[:k]) / max(sum(self.tried[:k]), 1e-9)
            d = max((1.0 - 1.0 / self.memory) ** batch, self.decay)
            for i in range(k, self.k_max):
                self.acc[i] = d * self.acc[i] + (1 - d) * pooled * self.tried[i]
        # The first steps of a request run on cold caches (right after the prefill, every forward
        # is slower) whatever K is, and `auto` takes its plain steps mostly there: their costs
        # would make plain decoding look dearer than it is over a request. They teach the costs
        # only of shapes not measured yet.
        if self._req_step is not None:  # requests are marked (`begin_request`): count this one's steps
            self._req_step += 1
        warm = self._req_step is None or self._req_step > self.cold_steps
        key = (batch, k + 1)
        if self.phase_rate and warm and verify_seconds > 0 and key in self.verify.means:
            # The machine's phase: every shape's cost moves with it (the VM of our bench ran 45%
            # faster for minutes while `auto` held one K, and shapes last read before kept their
            # old costs). Each warm verify of a shape read before moves it by its clipped log ratio
            # to the estimate, so readings are kept in one phase's units and a shape read long ago
            # stays comparable (a shape's first reading has only the line to compare with).
            est = self.verify.estimate(key, batch * (k + 1))
            if est is not None and est > 0:
                ratio = math.log(verify_seconds / est) - self.log_phase
                self.log_phase += self.phase_rate * min(max(ratio, -self.phase_band), self.phase_band)
        unit = math.exp(-self.log_phase)
        if warm or key not in self.verify.means:
            self.verify.observe(key, batch * (k + 1), verify_seconds * unit)
        if k > 0 and not self._skip_draft_cost and (warm or (batch, k) not in self.draft.means):
            self.draft.observe((batch, k), batch * k, draft_seconds * unit)
        self._skip_draft_cost = self._probe_unobserved = False
        self._memo_age += 1
        if self._memo_age >= 8 or self.steps < 32:
            self._memo.clear()
            self._memo_age = 0
        else:
            self._memo.pop((batch, k), None)

    def _seconds_memo(self, batch: int, k: int) -> float | None:
        s = self._memo.get((batch, k), self)
        if s is self:
            s = self._memo[(batch, k)] = self._unit_seconds(batch, k)
        return s


def summarize(history: list[int]) -> dict[int, int]:
    counts: dict[int, int] = defaultdict(int)
    for k in history:
        counts[k] += 1
    return dict(sorted(counts.items()))
