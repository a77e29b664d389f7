"""`SpecStats`: what a speculative run cost and what it bought.

Conventions (vLLM's): `mean_accepted_length` counts tokens emitted per target verify call
*including* the bonus / recovered token; `mean_accepted_drafts` is the same without it.
Per-position rates: `acceptance_rate_per_position[i]` is P(draft i accepted | drafts
0..i-1 accepted and a draft i proposed), over the row-steps that judged a draft at position i
(`offer_counts`); `acceptance_cumulative[i]` is P(drafts 0..i all accepted), their running
product. A step that drafted fewer positions (K = 0 under `num_draft_tokens="auto"`, a shorter K,
a chain cut at EOS or at `max_new_tokens`) does not count as rejecting the positions it never
proposed or emitted. For a tree, position i is depth i, judged after an accepted path up to the
tree's depth (a pruned tree's path may end sooner: its rates are then lower bounds). Counts are
per row-step, so a batch of B rows verified once counts B times. (Stats assembled without
`offer_counts` fall back to dividing by the previous position's count, the row-steps for
position 0.)

Only *emitted* tokens count: drafts accepted after an EOS or past `max_new_tokens` are cut
from the output and are not counted as accepted either (`verified_accepted` keeps the
rule's raw count for diagnostics).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    target_calls: int = 0  # verify forwards (prefill not included)
    prefill_calls: int = 0
    draft_calls: int | None = 0  # drafter forwards of the request (prompt prefill, catch-up, drafting); None = not reported
    new_tokens: list[int] = field(default_factory=list)  # per input row
    row_steps: int = 0  # sum over steps of active rows
    active_rows: list[int] = field(default_factory=list)  # [step]: rows verified in that step
    accepted_drafts: int = 0  # sum over row-steps of accepted draft tokens
    drafted_nodes: int = 0  # sum over row-steps of draft nodes proposed
    accept_counts: list[int] = field(default_factory=list)  # [i]: row-steps with >= i+1 accepted
    offer_counts: list[int] = field(default_factory=list)  # [i]: row-steps that judged a draft at position i
    emitted_tokens: int = 0  # sum over row-steps of tokens emitted (accepted drafts + bonus/recovered)
    verified_accepted: int = 0  # sum over row-steps of drafts the rule accepted, emitted or not
    nodes_per_step: list[int] = field(default_factory=list)  # [step]: draft nodes proposed per row
    lossless: bool = True  # whether the acceptance rule was lossless
    kernels: str = ""  # how the models' linear layers ran (e.g. "prepacked", "stock")
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    distortion_total: float = 0.0  # summed total variation of lossy rules (0 for exact rules; a lower bound for sampled drafts under LANTERN / GSD, see their docstrings)

    def record_step(self, num_accepted: list[int], num_nodes: int, emitted: list[int] | None = None,
                    depth: int | None = None) -> None:
        """One verify step: the rule's accepted counts per row, the nodes drafted per row, the
        tokens each row actually emitted (default: accepted + 1) and the draft positions offered
        (a chain's length, a tree's depth; default num_nodes)."""
        if emitted is None:
            emitted = [n + 1 for n in num_accepted]
        depth = num_nodes if depth is None else depth
        if depth > len(self.offer_counts):
            self.offer_counts.extend([0] * (depth - len(self.offer_counts)))
        self.target_calls += 1
        self.row_steps += len(num_accepted)
        self.active_rows.append(len(num_accepted))
        self.nodes_per_step.append(num_nodes)
        self.drafted_nodes += num_nodes * len(num_accepted)
        for n_raw, c in zip(num_accepted, emitted):
            n = min(n_raw, c)  # drafts cut by EOS / max_new_tokens were not emitted
            self.verified_accepted += n_raw
            self.emitted_tokens += c
            self.accepted_drafts += n
            if n > len(self.accept_counts):
                self.accept_counts.extend([0] * (n - len(self.accept_counts)))
            for i in range(n):
                self.accept_counts[i] += 1
            # positions judged: the accepted ones, and the rejected one after them unless the
            # row's output was cut there by EOS / max_new_tokens (its replacement not emitted,
            # as an accepted draft cut there is not counted either) or nothing more was drafted
            cut = n_raw > n or c <= n
            for i in range(n if cut else min(n + 1, depth)):
                self.offer_counts[i] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per row per target call, bonus token included."""
        return self.emitted_tokens / self.row_steps if self.row_steps else 0.0

    @property
    def mean_accepted_drafts(self) -> float:
        """Accepted draft tokens per row per target call (no bonus)."""
        return self.accepted_drafts / self.row_steps if self.row_steps else 0.0

    def _count(self, counts: list[int], i: int) -> int:
        return counts[i] if i < len(counts) else 0

    @property
    def acceptance_cumulative(self) -> list[float]:
        """[i]: P(drafts 0..i all accepted): the per-position rates' running product."""
        if not self.offer_counts:  # assembled without them: over all row-steps
            return [c / self.row_steps for c in self.accept_counts] if self.row_steps else []
        out, p = [], 1.0
        for r in self.acceptance_rate_per_position:
            p *= r
            out.append(p)
        return out

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        """[i]: P(draft i accepted | drafts 0..i-1 accepted) among row-steps that judged position i."""
        if not self.offer_counts:  # assembled without them: the previous position's count
            out, prev = [], self.row_steps
            for c in self.accept_counts:
                out.append(c / prev if prev else 0.0)
                prev = c
            return out
        # the positions offered are a prefix 0..j in each row-step: zero counts only trail
        return [self._count(self.accept_counts, i) / o for i, o in enumerate(self.offer_counts) if o]

    @property
    def mean_distortion(self) -> float:
        """Mean total variation moved per row-step by a lossy rule (0 for lossless rules)."""
        return self.distortion_total / self.row_steps if self.row_steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return sum(self.new_tokens) / self.total_seconds if self.total_seconds > 0 else 0.0

    def summary(self) -> str:
        rates = ", ".join(f"{r:.2f}" for r in self.acceptance_rate_per_position[:8])
        return (
            f"new tokens {sum(self.new_tokens)} in {self.total_seconds:.2f}s "
            f"({self.tokens_per_second:.1f} tok/s); target calls {self.target_calls}, draft calls "
            f"{self.draft_calls}; mean accepted length {self.mean_accepted_length:.2f} "
            f"(drafts {self.mean_accepted_drafts:.2f}); per-position acceptance [{rates}]; "
            f"draft {self.draft_seconds:.2f}s / verify {self.verify_seconds:.2f}s"
            + (f"; kernels: {self.kernels}" if self.kernels else "")
            + ("" if self.lossless else f"; lossy rule: distortion {self.distortion_total:.3f} total, "
               f"{self.mean_distortion:.4f} per row-step")
        )
