"""Greedy chain acceptance read off a plain stretch, without drafting ("shadow probes").

Under greedy decoding with a lossless rule a chain of drafts started after committed token t_j
is accepted for exactly as long as the drafter's greedy predictions along the target's own
output agree with it: draft 1 is the drafter's argmax after t_j, and once it equals t_(j+1) the
drafter's next input is the same prefix it would see under teacher forcing, so draft 2 is its
teacher-forced prediction after t_(j+1), and so on (up to batch numerics). One drafter forward
over the tokens the target emitted while decoding plainly, with logits at every position, thus
gives for every start j the accepted length min(K, L_j), where L_j is the run of agreements
from j: what a probe of every K at every step of the stretch would have measured, for the price
of the catch-up forward that drafting would pay anyway (and with no verify of drafts, no rows
left at different lengths, no draft steps).

`chain_counts` turns each row's agreement flags into per-position (tried, accepted) counts: at
chain position i (0-based) a start j is tried when its first i drafts were accepted (L_j >= i)
and accepted when L_j > i; positions past a row's last flag are unknown and not counted (a run
that reaches the end is censored there).

The same identity underlies benchmarks/auto_sim.py's replay (one drafter forward along a target
`generate` gives every step's accepted count). Speculative decoding with a teacher-forced
acceptance estimate is, to our knowledge, our own device; the adaptive draft-length schedules it
feeds are cited in mmspec/adaptive.py.
"""

from __future__ import annotations


def chain_counts(hits: list[list[bool]], k_max: int) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """`hits[b][j]`: whether the drafter's greedy prediction after row b's j-th stretch token
    equals the token the target emitted next. Returns (tried, accepted) per chain position
    0..k_max-1 summed over rows and starts, and per row (first-draft agreements, flags)."""
    tried, accepted = [0] * k_max, [0] * k_max
    per_row = []
    for row in hits:
        n = len(row)
        per_row.append((sum(1 for h in row if h), n))
        run = 0
        for j in range(n - 1, -1, -1):  # L_j, right to left
            run = run + 1 if row[j] else 0
            for i in range(min(k_max, n - j)):  # position i reads flag j + i
                if run < i:
                    break
                tried[i] += 1
                if run > i:
                    accepted[i] += 1
    return tried, accepted, per_row
