"""Drafter-invariant verification: sampled output that does not depend on the drafter.

Source: Daliri, Musco and Suresh, "Coupling without Communication and Drafter-Invariant
Speculative Decoding" (arXiv 2408.07978, 2024; no reference code used: written from the paper). Every generated position t owns a Gumbel noise
vector g_t drawn from the request's seed alone (`mmspec.position_noise.PositionNoise`), and the
token emitted there is ``argmax(log p_t + g_t)``: Gumbel-max sampling, an exact sample from the
target's processed distribution p_t (temperature, top-k, top-p applied). Verification is greedy
verification of those perturbed argmaxes: a draft is kept while it equals the perturbed
argmax, the first mismatch is replaced by it, and the bonus position emits it too.

So for a given seed the output is token for token the output of plain decoding with this rule
(`speculative=False`, or a drafter that drafts nothing), whatever the drafter, its draft
length, its tree, or a draft length chosen from timings (`"auto"`). Exact speculative sampling
(`"exact"`) is distributed like the target too, but the tokens it draws depend on the drafts.
The price: a draft drawn as ``argmax(log q + g_t)`` with the same noise (the Jacobi drafter's
Gumbel coupling and the small-model drafters do this when the loop hands them the noise) is
accepted with probability >= (1 - TV) / (1 + TV) against 1 - TV for exact verification.

Division of work: the speculative loop (`speculative_generate`) makes the request's noise and
replaces each target distribution by the one-hot of its perturbed argmax before calling the
rule (rules do not know positions); the rule is then greedy verification. Called on its own,
`verify` therefore requires one-hot targets and refuses anything else (with the noise in hand,
`PositionNoise.perturb` makes them). At temperature 0 it is greedy verification.
"""

from __future__ import annotations

import torch

from mmspec.sampling import check_generator
from mmspec.types import AcceptanceResult

from .base import check_chain_inputs
from .greedy import GreedyAcceptance


class DrafterInvariantAcceptance(GreedyAcceptance):
    """Lossless; its output for a seed is the same with every drafter (see module docstring)."""

    lossless = True
    name = "invariant"
    greedy_only = False  # it samples (through the loop's position-keyed noise)
    position_keyed = True  # the loop perturbs the target's distributions with position-keyed noise

    def verify(self, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor, *,
               generator: torch.Generator | None = None) -> AcceptanceResult:
        check_chain_inputs(draft_tokens, draft_probs, target_probs)
        check_generator(generator)
        top = target_probs.amax(-1)
        if not bool(((top == 1) & ((target_probs == 0) | (target_probs == 1)).all(-1)).all()):  # SYNC: validation
            raise ValueError(
                "DrafterInvariantAcceptance verifies the target's Gumbel-perturbed argmaxes: target_probs must be "
                "one-hot (speculative_generate makes them from position-keyed noise; on your own, pass "
                "mmspec.position_noise.PositionNoise.perturb(p, rows, starts)), got distributions that are not one-hot")
        return self.verify_unchecked(draft_tokens, draft_probs, target_probs, generator=generator)

    def verify_top(self, draft_tokens: torch.Tensor, top: torch.Tensor) -> AcceptanceResult:
        """The chain verdict from the perturbed argmax tokens themselves, `top` [B, K+1] (what the
        loop computes; the same result as `verify` on their one-hots, without building them)."""
        K = draft_tokens.shape[1]
        match = top[:, :K] == draft_tokens
        num_accepted = match.long().cumprod(1).sum(1)
        return AcceptanceResult(num_accepted, top.gather(1, num_accepted.unsqueeze(1)).squeeze(1), None,
                                match.to(torch.float32))

    def at_temperature_zero(self):
        """Greedy decoding has no noise: greedy verification."""
        return GreedyAcceptance()
