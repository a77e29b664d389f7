"""Exact speculative sampling (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023,
arXiv 2302.01318; no reference code used: written from the papers' algorithm boxes).

Accept draft x with probability min(1, p(x) / q(x)); at the first rejection draw from
norm(max(p - q, 0)); after K acceptances draw the bonus token from p. The output is
distributed exactly like sampling from p. A deterministic drafter has q = one_hot(x), so
alpha = p(x) and the residual is p with x removed. When p == q the residual is zero; that
case is never reached by the acceptance test (alpha == 1), and `normalize` falls back to p
so no NaN can escape through rounding.
"""

from __future__ import annotations

import torch

from .base import ChainRule
from mmspec.sampling import normalize


def candidate_probs(x: torch.Tensor, dist: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """dist(x) per row; a missing distribution means a one-hot drafter, so 1."""
    if dist is None:
        return torch.ones_like(like[:, 0])
    return dist.gather(-1, x.unsqueeze(-1)).squeeze(-1)


def capped_ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """min(1, num / den); a zero denominator (a draft q could not have produced) accepts
    whenever the numerator is positive."""
    # num / 0 = inf for num > 0, capped to 1; num = 0 gives 0 whatever den is (0 / 0 = NaN is
    # never selected). Four operations (it runs at every verification).
    return torch.where(num > 0, (num / den).clamp(max=1.0), 0.0)


def exact_residual(x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
    """norm(max(p - q, 0)); for a one-hot draft, p without x. Falls back to p when empty."""
    weights = p.scatter(-1, x.unsqueeze(-1), 0.0) if q is None else (p - q).clamp_min(0.0)
    return normalize(weights, p)


class ExactAcceptance(ChainRule):
    """Lossless speculative sampling."""

    lossless = True
    name = "exact"

    def accept_probability(self, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
        px = p.gather(-1, x.unsqueeze(-1)).squeeze(-1)
        return capped_ratio(px, candidate_probs(x, q, p))

    def residual(self, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
        return exact_residual(x, p, q)

    def at_temperature_zero(self):
        """Exact verification of a one-hot p is greedy verification (first mismatch stops,
        the target's argmax is the next token); the loop uses the cheaper rule then."""
        from .greedy import GreedyAcceptance

        return GreedyAcceptance()
