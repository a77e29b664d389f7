"""Greedy verification (temperature 0).

Accept the longest prefix of draft tokens that equal the target's argmax; the next token is
the argmax at the first mismatch (or at the bonus position). Reproduces plain greedy
decoding token for token. Ties go to the lowest token id, like `torch.argmax`.
"""

from __future__ import annotations

import torch

from mmspec.types import AcceptanceResult

from .base import ChainRule


class GreedyAcceptance(ChainRule):
    """Lossless with respect to greedy decoding."""

    lossless = True
    name = "greedy"
    # It emits argmaxes whatever the sampling settings: the loop refuses it unless temperature
    # is 0 (with temperature > 0 it would silently decode greedily).
    greedy_only = True

    def accept_probability(self, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
        return (p.argmax(-1) == x).to(p.dtype)

    def residual(self, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
        # A rejected x is not the argmax, so the argmax of p is still the answer.
        return p

    def sample(self, p: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        return p.argmax(-1)

    def verify_unchecked(self, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                         target_probs: torch.Tensor, *, generator: torch.Generator | None = None) -> AcceptanceResult:
        """The chain verification of `ChainRule.verify_unchecked` for this rule, in a few operations
        (the loop calls it every step of greedy decoding): a draft is accepted while it equals
        the target's argmax, and the next token is the argmax at the first mismatch or the bonus
        position. Same results as the generic path; draws no random numbers."""
        K = draft_tokens.shape[1]
        top = target_probs.argmax(-1)  # [B, K+1]
        match = top[:, :K] == draft_tokens
        num_accepted = match.long().cumprod(1).sum(1)
        next_tokens = top.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
        dtype = torch.float64 if target_probs.dtype == torch.float64 else torch.float32
        return AcceptanceResult(num_accepted, next_tokens, None, match.to(dtype))
