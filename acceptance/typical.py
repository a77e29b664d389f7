"""Typical acceptance (Medusa; Cai et al. 2024, arXiv 2401.10774, github.com/FasterDecoding/Medusa).

Accept draft x when the target finds it "typical enough":

    p(x) > min(epsilon, alpha * exp(-H(p)))                         (Medusa, section 2.3.1)

with H(p) the entropy of the processed target distribution. Flat distributions (high
entropy) lower the threshold, peaked ones raise it up to `epsilon`. The decision is
deterministic given p (alpha is 0 or 1), so the uniform `ChainRule.verify` draws per
position cannot change it.

Residual: Medusa never resamples from a modified distribution; the token after the accepted
prefix is drawn from the target distribution at that position. We do the same: `residual`
returns p unchanged, which also makes the tree walk (`mmspec.tree.verify_tree`) judge every
sibling against the same p, as Medusa's candidate paths are. The recovered / bonus token is
sampled from p (Medusa's "first token" is the target's own token).

Limits: lossy (the output is not distributed like p) and meant for deterministic drafters
(Medusa heads, top-k trees); a draft distribution q, when given, is ignored. The distortion
reported per candidate is the over-accepted mass of the unifying view in docs/algorithms.md,
`max(0, a(x) - p(x)) = accepted * (1 - p(x))` for a one-hot draft.
"""

from __future__ import annotations

import math

import torch

from .base import ChainRule
from mmspec.sampling import plain_number


def entropy(p: torch.Tensor) -> torch.Tensor:
    """p [M, V] -> H(p) [M] in nats, with 0 log 0 = 0."""
    return -torch.special.xlogy(p, p).sum(-1)


class TypicalAcceptance(ChainRule):
    """Medusa's entropy-dependent threshold rule. Defaults are Medusa's
    (`posterior_threshold=0.09`, `posterior_alpha=0.3`)."""

    lossless = False
    name = "typical"

    def __init__(self, epsilon: float = 0.09, alpha: float = 0.3) -> None:
        epsilon, alpha = plain_number(epsilon), plain_number(alpha)
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not (0.0 <= float(epsilon) <= 1.0):
            raise ValueError(f"epsilon must be a probability threshold in [0, 1], got {epsilon!r}")
        # NaN / inf made the threshold NaN (inf * exp(-H) is NaN where exp(-H) underflows to 0)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (0.0 <= float(alpha) < math.inf):
            raise ValueError(f"alpha must be a finite number >= 0, got {alpha!r}")
        self.epsilon = float(epsilon)
        self.alpha = float(alpha)

    def threshold(self, p: torch.Tensor) -> torch.Tensor:
        """p [M, V] -> min(epsilon, alpha * exp(-H(p))) [M]."""
        return torch.clamp(self.alpha * torch.exp(-entropy(p)), max=self.epsilon)

    def accept_probability(self, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
        px = p.gather(-1, x.unsqueeze(-1)).squeeze(-1)
        return (px > self.threshold(p)).to(p.dtype)

    def residual(self, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
        return p

    def at_temperature_zero(self) -> "TypicalAcceptance":
        """At temperature 0 p is a one-hot with entropy 0, so the threshold is min(epsilon, alpha)
        < 1 = p(argmax) (or >= 1, and nothing is accepted): only the argmax is ever accepted and
        the next token is the argmax. That is greedy decoding token for token, so the loop's
        copy of the rule reports itself lossless (`SpecStats.lossless`)."""
        rule = TypicalAcceptance(self.epsilon, self.alpha)
        rule.lossless = True
        return rule

    def distortion(self, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
        return self.distortion_given(x, p, q, self.accept_probability(x, p, q))

    def distortion_given(self, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None,
                         alpha: torch.Tensor) -> torch.Tensor:
        px = p.gather(-1, x.unsqueeze(-1)).squeeze(-1)
        return alpha * (1.0 - px)
