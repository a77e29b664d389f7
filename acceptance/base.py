"""Shared chain verification for discrete acceptance rules.

A discrete rule is fully described by three per-candidate pieces (docs/algorithms.md section 1,
"Relaxed rules, one view"): the probability `alpha(x)` of accepting candidate x given the target
distribution p and the draft distribution q, the distribution to continue with after a
rejection, and how the final (recovered / bonus) token is drawn. `ChainRule.verify` runs
them for a whole batch of chains at once: one uniform per position, the accepted prefix is
the run of leading successes, the next token comes from the residual at the first failure
(or from p at the bonus position). No Python loop over rows or positions and no host sync.
The core's tree walk (`mmspec.tree.verify_tree`) uses the same three pieces.
"""

from __future__ import annotations

import torch

from mmspec.sampling import cached_arange, check_distributions, check_generator, draw, ids_in_range, sample_from
from mmspec.types import AcceptanceResult


def check_chain_inputs(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor
) -> None:
    """Raise a ValueError naming the argument when chain inputs do not fit together."""
    if not isinstance(draft_tokens, torch.Tensor) or draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be a [B, K] tensor, got {getattr(draft_tokens, 'shape', type(draft_tokens))}")
    if draft_tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"draft_tokens must hold integer token ids, got dtype {draft_tokens.dtype}")
    B, K = draft_tokens.shape
    if not isinstance(target_probs, torch.Tensor) or target_probs.dim() != 3:
        raise ValueError(f"target_probs must be a [B, K+1, V] tensor, got {getattr(target_probs, 'shape', type(target_probs))}")
    if target_probs.shape[0] != B or target_probs.shape[1] != K + 1:
        raise ValueError(
            f"target_probs must have shape [B, K+1, V] = [{B}, {K + 1}, V] for draft_tokens of shape "
            f"{tuple(draft_tokens.shape)}, got {tuple(target_probs.shape)}"
        )
    if not target_probs.is_floating_point():
        raise ValueError(f"target_probs must be floating point probabilities, got dtype {target_probs.dtype}")
    V = target_probs.shape[2]
    if V == 0:
        raise ValueError("target_probs has an empty vocabulary (V = 0); a distribution needs at least one token")
    if not ids_in_range(draft_tokens, V):  # SYNC: input validation
        raise ValueError(f"draft_tokens must lie in [0, V={V}); got values outside that range")
    if draft_probs is not None:
        if not isinstance(draft_probs, torch.Tensor) or tuple(draft_probs.shape) != (B, K, V):
            raise ValueError(
                f"draft_probs must be None or have shape [B, K, V] = [{B}, {K}, {V}], "
                f"got {tuple(getattr(draft_probs, 'shape', ()))}"
            )
    # Probabilities, not logits (the loop checks its own distributions; this is for direct
    # callers of `verify`).
    check_distributions("target_probs", target_probs)
    check_distributions("draft_probs", draft_probs)


class ChainRule:
    """Base class: subclasses implement `accept_probability`, `residual` and optionally
    `sample` and `distortion`; `verify` is shared."""

    lossless: bool = True

    def accept_probability(self, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
        """x [M], p [M, V], q [M, V] | None -> alpha [M] in [0, 1]."""
        raise NotImplementedError

    def residual(self, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
        """x [M], p [M, V], q [M, V] | None -> distribution [M, V] after rejecting x."""
        raise NotImplementedError

    def sample(self, p: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """p [M, V] -> token [M]: the recovered or bonus token."""
        return sample_from(p, generator)

    def distortion(self, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor | None:
        """x [M], p [M, V], q [M, V] | None -> total variation [M] this candidate's acceptance
        can move the output away from p, or None for lossless rules."""
        return None

    def distortion_given(self, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None,
                         alpha: torch.Tensor) -> torch.Tensor | None:
        """`distortion(x, p, q)` when the loop already holds `alpha = accept_probability(x, p, q)`
        [M]; rules whose distortion is a function of alpha override it to skip recomputing it."""
        return self.distortion(x, p, q)

    def accept_and_distortion(self, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None
                              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [M], p [M, V], q [M, V] | None -> (alpha [M], distortion [M] | None): both per-candidate
        quantities of a verification in one call, so that a rule whose two share work (LANTERN's
        neighbour mass) computes it once per step."""
        alpha = self.accept_probability(x, p, q)
        return alpha, self.distortion_given(x, p, q, alpha)

    def verify(
        self,
        draft_tokens: torch.Tensor,  # [B, K]
        draft_probs: torch.Tensor | None,  # [B, K, V] or None
        target_probs: torch.Tensor,  # [B, K+1, V]
        *,
        generator: torch.Generator | None = None,
    ) -> AcceptanceResult:
        check_chain_inputs(draft_tokens, draft_probs, target_probs)
        check_generator(generator)
        return self.verify_unchecked(draft_tokens, draft_probs, target_probs, generator=generator)

    def verify_unchecked(
        self,
        draft_tokens: torch.Tensor,  # [B, K]
        draft_probs: torch.Tensor | None,  # [B, K, V] or None
        target_probs: torch.Tensor,  # [B, K+1, V]
        *,
        generator: torch.Generator | None = None,
    ) -> AcceptanceResult:
        """`verify` without input validation (which needs a host sync to range-check token
        ids); the speculative loop calls this, since it builds the inputs itself."""
        B, K = draft_tokens.shape
        V = target_probs.shape[-1]
        dtype = torch.float64 if target_probs.dtype == torch.float64 else torch.float32
        if target_probs.dtype != dtype:  # (each skipped call is one operation fewer in the hot path)
            target_probs = target_probs.to(dtype)
        if draft_probs is not None and draft_probs.dtype != dtype:
            draft_probs = draft_probs.to(dtype)
        device = draft_tokens.device
        if K == 0:
            return AcceptanceResult(
                num_accepted=torch.zeros(B, dtype=torch.long, device=device),
                next_tokens=self.sample(target_probs[:, 0], generator),
                accept_probs=target_probs.new_zeros(B, 0),
            )
        x = (draft_tokens if draft_tokens.dtype == torch.long else draft_tokens.long()).reshape(-1)  # [B*K]
        p = target_probs[:, :K].reshape(-1, V)  # [B*K, V]
        q = None if draft_probs is None else draft_probs.reshape(-1, V)
        alpha, dist = self.accept_and_distortion(x, p, q)
        alpha = alpha.view(B, K)
        u = draw(torch.rand, B, K, generator=generator, dtype=dtype, device=alpha.device)
        # alpha == 1 always accepts (u < 1), alpha == 0 never does; the accepted prefix is the
        # run of leading successes (a bool cumprod counts in int64).
        num_accepted = (u < alpha).cumprod(1).sum(1)  # [B]
        # Residual at the first rejection (flat row b * K + min(n_b, K - 1)); the bonus row K
        # takes p_K as it is.
        at = num_accepted.clamp(max=K - 1) + cached_arange(0, B * K, K, device)
        resid = self.residual(x.index_select(0, at), p.index_select(0, at), None if q is None else q.index_select(0, at))
        final = torch.where((num_accepted == K).unsqueeze(-1), target_probs[:, K], resid)
        next_tokens = self.sample(final, generator)
        step_distortion = None
        if dist is not None:
            # Every position up to and including the first rejection was decided by the rule.
            visited = cached_arange(0, K, 1, device).unsqueeze(0) <= num_accepted.unsqueeze(1)
            step_distortion = (dist.view(B, K) * visited).sum(1)
        return AcceptanceResult(num_accepted, next_tokens, step_distortion, alpha)

