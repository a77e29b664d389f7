"""Exact speculative sampling (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023,
arXiv 2302.01318).

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


class ExactAcceptance(ChainRule):
    """Lossless speculative sampling."""

    lossless = True
    name = "exact"

    def accept_probability(self, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
        px = p.gather(-1, x.unsqueeze(-1)).squeeze(-1)
        qx = candidate_probs(x, q, p)
        # q(x) == 0 cannot happen for a token drawn from q; treat it as "any p(x) > 0 accepts".
        ratio = torch.where(qx > 0, px / qx.clamp_min(torch.finfo(p.dtype).tiny), (px > 0).to(p.dtype))
        return ratio.clamp(max=1.0)

    def residual(self, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
        if q is None:
            weights = p.scatter(-1, x.unsqueeze(-1), 0.0)
        else:
            weights = (p - q).clamp_min(0.0)
        return normalize(weights, p)
