"""Greedy verification (temperature 0).

Accept the longest prefix of draft tokens that equal the target's argmax; the next token is
the argmax at the first mismatch (or at the bonus position). Reproduces plain greedy
decoding token for token. Ties go to the lowest token id, like `torch.argmax`.
"""

from __future__ import annotations

import torch

from .base import ChainRule


class GreedyAcceptance(ChainRule):
    """Lossless with respect to greedy decoding."""

    lossless = True
    name = "greedy"

    def accept_probability(self, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
        return (p.argmax(-1) == x).to(p.dtype)

    def residual(self, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
        # A rejected x is not the argmax, so the argmax of p is still the answer.
        return p

    def sample(self, p: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        return p.argmax(-1)
