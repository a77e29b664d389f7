"""Step costs for the adaptive draft length (`mmspec/adaptive.py`): seconds per step shape,
learned from the wall clock of past steps.

`StepCosts` keeps, per key (active rows, tokens a row) a running mean of the measured seconds and,
over every observation, a least-squares line in the tokens a step processes, so that a shape
never run still gets an estimate. A shape run only a few times is shrunk toward the line through
the other shapes of its row count (see `StepCosts.estimate`).
"""

from __future__ import annotations

import math


class StepCosts:
    """seconds ~ c0 + c1 * tokens, a least-squares line kept as discounted running sums (O(1)
    per step, no history kept); plus running means for each observed key, which are
    preferred when present.

    First observations are provisional where this machine shows one-time costs. A shape's first
    run may pay work its later runs do not (on the H100 of session 30 keys seen once cost
    30-160% more than repeated ones: kernel and plan selection, allocator growth), and a shape
    that looks dear is rarely chosen again: `auto` stayed at K = 3 where K = 5-8 ran faster. On
    a CPU a first run costs what later ones do, and treating it as provisional there cost ~2%.
    So it is measured: every key's first reading is compared with its second, and once two keys
    have shown it and their geometric-mean ratio is above `one_time_ratio`, (1) a cheaper second
    observation replaces the first instead of being averaged with it, and (2) while a key has
    been seen once, its estimate is at most what the line through repeated observations (of
    other keys) predicts for it, so it is tried once more before it is trusted.
    """

    # An observation counts at most this many times the running mean of its key: the rest of
    # the machine only ever slows a step down (another process, a page fault, a timer), and one
    # such outlier would otherwise move the estimate by (1 - decay) x its size. A lasting rise
    # still comes through, by up to 50% x (1 - decay) per step.
    clip = 1.5
    one_time_ratio = 1.2  # first / second reading (geometric mean over keys) that marks one-time costs

    def __init__(self, decay: float):
        self.decay = decay
        self.means: dict = {}
        self.counts: dict = {}  # observations per key
        # Least-squares sums (weight, sum x, sum y, sum xx, sum xy; discounted): over every
        # observation (the estimate of keys never seen) and over repeat observations only.
        self.sums = [0.0] * 5
        self.repeat_sums = [0.0] * 5
        self._lines: dict = {}
        self._group_sums: dict = {}  # row count -> sums over its keys (`_neighbours`), until the next reading
        # A key read fewer than `shrink_below` times is blended with its neighbours' line, which
        # counts as `prior_readings` readings (`estimate`).
        self.shrink_below = max(2, round(1.0 / (1.0 - decay))) if decay < 1.0 else 2
        self.prior_readings = 2.0
        self._first_log_ratios = [0.0, 0]  # sum of log(first / second) over keys seen twice, count

    def first_reading_ratio(self) -> tuple[int, float | None]:
        """(keys seen twice, geometric mean of their first / second reading; None before any)."""
        total, n = self._first_log_ratios
        return n, (math.exp(total / n) if n else None)

    @property
    def one_time_costs(self) -> bool:
        """Whether first readings run dear on this machine (measured: see the class docstring)."""
        n, ratio = self.first_reading_ratio()
        return n >= 2 and ratio > self.one_time_ratio

    def observe(self, key, tokens: float, seconds: float) -> None:
        old = self.means.get(key)
        n = self.counts.get(key, 0)
        if n == 1 and old > 0 and seconds > 0:
            self._first_log_ratios[0] += math.log(old / seconds)
            self._first_log_ratios[1] += 1
        if old is None or (n == 1 and seconds < old and self.one_time_costs):
            self.means[key] = seconds
        else:
            # The plain average of a key's readings until it has 1 / (1 - decay) of them, then a
            # running mean: at a fixed 1 - decay a key's second reading weighed 10%, so one
            # noisy first reading of a shape the controller then avoided (chosen only at probes,
            # every 16-64 steps or rarer) kept its estimate off for hundreds of steps.
            # A second reading that is much cheaper than the first, before the machine is known
            # to have one-time costs or not, keeps the old weight: that is their signature.
            w = max(1.0 / (n + 1), 1.0 - self.decay)
            if n == 1 and old > self.one_time_ratio * seconds and self.first_reading_ratio()[0] < 2:
                w = 1.0 - self.decay  # a first reading that may carry one-time costs: undecided yet
            self.means[key] = (1.0 - w) * old + w * min(seconds, self.clip * old)
        self.counts[key] = n + 1
        g = 0.99  # the lines forget slowly: they only fill in shapes not (or once) seen
        for sums in (self.sums, self.repeat_sums) if n else (self.sums,):
            w, sx, sy, sxx, sxy = (v * g for v in sums)
            sums[:] = [w + 1, sx + tokens, sy + seconds, sxx + tokens * tokens, sxy + tokens * seconds]
        self._lines = {}
        self._group_sums = {}

    def line(self, repeats: bool = False) -> tuple[float, float, float] | None:
        """(mean seconds, slope >= 0, mean tokens) of the fit, or None before any observation."""
        if repeats not in self._lines:
            w, sx, sy, sxx, sxy = self.repeat_sums if repeats else self.sums
            fit = None
            if w > 0:
                mx, my = sx / w, sy / w
                var = sxx / w - mx * mx
                slope = (sxy / w - mx * my) / var if var > 1e-12 else 0.0
                fit = (my, max(slope, 0.0), mx)  # more tokens never cost less
            self._lines[repeats] = fit
        return self._lines[repeats]

    def _predict(self, tokens: float, repeats: bool = False) -> float | None:
        line = self.line(repeats)
        if line is None:
            return None
        my, slope, mx = line
        return max(my + slope * (tokens - mx), 0.0)

    def estimate(self, key, tokens: float) -> float | None:
        mean = self.means.get(key)
        if mean is None:
            return self._predict(tokens)
        n = self.counts[key]
        if n < self.shrink_below:
            near = self._neighbours(key)
            if near is not None and near > 0:
                # A key read a few times is noisy (one reading carries the step's full noise) and
                # is read again only when chosen or probed, so that noise decides rankings for
                # long: weigh it against the line through the other shapes of its row count, as
                # `prior_readings` readings.
                mean = (n * mean + self.prior_readings * near) / (n + self.prior_readings)
        if n == 1 and self.one_time_costs:  # (after the blend: its neighbours may be once-seen too)
            again = self._predict(tokens, repeats=True)
            if again is not None:
                mean = min(mean, again)
        return mean

    def _neighbours(self, key) -> float | None:
        """For a key (rows, tokens a row): the seconds that the least-squares line in tokens a row
        through the other keys of the same row count (weighted by readings) predicts; None with
        fewer than two such keys or keys of another form."""
        if not (isinstance(key, tuple) and len(key) == 2):
            return None
        group, x = key
        if not self._group_sums:  # every row count's sums in one pass over the keys (once per reading)
            groups = self._group_sums
            for k, m in self.means.items():
                if isinstance(k, tuple) and len(k) == 2:
                    c, q = self.counts[k], k[1]
                    sums = groups.get(k[0])
                    if sums is None:
                        sums = groups[k[0]] = [0.0] * 6  # readings, keys, sum c x, c y, c x x, c x y
                    sums[0] += c
                    sums[1] += 1
                    sums[2] += c * q
                    sums[3] += c * m
                    sums[4] += c * q * q
                    sums[5] += c * q * m
        sums = self._group_sums[group]
        c, m = self.counts[key], self.means[key]
        w, keys, sx, sy, sxx, sxy = (a - b for a, b in zip(sums, (c, 1, c * x, c * m, c * x * x, c * x * m)))
        if keys < 2 or w <= 0:
            return None
        mx, my = sx / w, sy / w
        var = sxx / w - mx * mx
        if var <= 1e-12:
            return None
        slope = max((sxy / w - mx * my) / var, 0.0)  # more tokens never cost less
        return my + slope * (x - mx)
