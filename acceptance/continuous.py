"""Continuous speculative decoding for diffusion-head tokens, CSpD (Wang et al., arXiv
2411.11925; public code: github.com/MarkXCloud/CSpD, `spec_decode/spec_decode_runner.py`).

A continuous-token AR model (MAR) samples each token x in R^D with a small diffusion head.
With *denoising trajectory alignment* draft and target denoise from the same initial noise
with the same per-step noise, so both reach their last step from coupled states, and the
last step of each is a Gaussian: q = N(mu_q, diag sigma_q^2) for the draft,
p = N(mu_p, diag sigma_p^2) for the target. The draft's token x ~ q is verified with

    log r(x) = log N(x; mu_p, sigma_p) - log N(x; mu_q, sigma_q)             (final step)
             + sum_d (S_q,d - S_p,d)                                          (trajectory, optional)
    accept x with probability min(1, r(x))

and on rejection a token is drawn from norm(max(0, p~ - q~)), where p~ = N_p * exp(-S_p) and
q~ = N_q * exp(-S_q) are the densities whose ratio is r, by acceptance-rejection sampling:
propose y ~ N(mu_p, sigma_p) and keep it with probability max(0, 1 - 1 / r(y)). The bound
max(0, p~ - q~) <= p~ makes this valid without computing any integral (CSpD section 3.3).
At most `max_tries` proposals are drawn per token (vectorised, no early exit, so no host
sync); a token whose tries all fail falls back *explicitly* to a plain target sample
y ~ N(mu_p, sigma_p) and is counted in `ContinuousResult.fallbacks`.

The trajectory term. Each earlier denoising step t is x_{t-1} = mu_t + sigma_t * eps_t with
the shared eps_t, so the Gaussian exponents of both models at their own aligned states are
both -eps_t^2 / 2 and cancel; what is left of the density ratio of step t is the ratio of the
normalisers, prod_d sigma_q,t,d / sigma_p,t,d. `S_m = sum_t log sigma_m,t` (per dimension, or
already summed over D) accumulates these log-stds over the steps before the last. The public
code multiplies by exp(sum(S_p - S_q)) instead (the inverse); we follow the Gaussian algebra
and flag the difference here. It also flattens the final-step exponents with an "inner
temperature" of 42, a lossy heuristic not reproduced.

Exactness. Without the trajectory term (S not given) the rule is exact speculative sampling
from the final-step Gaussian p, conditioned on the aligned trajectory up to the last step;
since the target's own sampler draws its token from exactly that Gaussian given those
states, the emitted tokens follow the target's distribution (up to the counted fallbacks).
For this, the draft's last step must draw x = mu_q + sigma_q * eps with fresh noise (MAR's
DDPM sampler adds no noise at t = 0; give it the last step's posterior std instead). With the
trajectory term the acceptance ratio follows the paper's trajectory-level ratio, which is
not exact conditioned on the aligned states.

MAR is a masked, set-wise model: `accept_tokens` judges every drafted token independently
(outcome per token); `verify` gives the chain view used by the speculative loop (accepted
prefix, then the residual sample at the first rejection or a bonus sample from position K).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mmspec.sampling import check_generator, draw, plain_number


@dataclass
class ContinuousResult:
    """Outcome of verifying continuous draft tokens."""

    num_accepted: torch.Tensor  # [B] long: length of the accepted prefix
    next_samples: torch.Tensor | None  # [B, D]: residual or bonus sample after the prefix (verify only)
    accepted: torch.Tensor  # [B, K] bool: each token's own accept decision
    samples: torch.Tensor  # [B, K, D]: draft where accepted, residual sample where rejected (verify: first rejection only)
    accept_probs: torch.Tensor  # [B, K] float: min(1, r(x))
    fallbacks: torch.Tensor  # [B] long: residual draws that used the explicit fallback
    fell_back: torch.Tensor  # [B, K] bool: which residual samples are fallbacks


def gaussian_log_density(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """log N(x; mean, diag std^2) summed over the last dim: [..., D] -> [...]."""
    z = (x - mean) / std
    return (-0.5 * z * z - torch.log(std) - 0.5 * math.log(2 * math.pi)).sum(-1)


class ContinuousAcceptance:
    """CSpD verification of continuous tokens from Gaussian final denoising steps."""

    lossless = True  # without the optional trajectory term; see the module docstring
    name = "continuous"

    def __init__(self, max_tries: int = 64, tries_per_block: int = 16) -> None:
        max_tries, tries_per_block = plain_number(max_tries), plain_number(tries_per_block)
        if isinstance(max_tries, bool) or not isinstance(max_tries, int) or max_tries < 1:
            raise ValueError(f"max_tries must be an int >= 1, got {max_tries!r}")
        if isinstance(tries_per_block, bool) or not isinstance(tries_per_block, int) or tries_per_block < 1:
            raise ValueError(f"tries_per_block must be an int >= 1, got {tries_per_block!r}")
        self.max_tries = max_tries
        self.tries_per_block = tries_per_block

    # -- pieces -------------------------------------------------------------------------

    @staticmethod
    def _offset(draft_logstd_sum: torch.Tensor | None, target_logstd_sum: torch.Tensor | None, like: torch.Tensor):
        """Trajectory term sum_d (S_q - S_p) [...] (0 when not given)."""
        if draft_logstd_sum is None and target_logstd_sum is None:
            return torch.zeros_like(like[..., 0])
        # Each term summed over D on its own: [B, K, D] beside [B, K] broadcast along the wrong axes
        # (with K == D silently: a wrong offset and acceptance probability).
        sq = draft_logstd_sum.to(like.dtype)
        sp = target_logstd_sum.to(like.dtype)
        sq = sq.sum(-1) if sq.dim() == like.dim() else sq
        sp = sp.sum(-1) if sp.dim() == like.dim() else sp
        return sq - sp

    def log_ratio(
        self,
        x: torch.Tensor,  # [..., D]
        draft_mean: torch.Tensor,  # [..., D]
        draft_std: torch.Tensor,  # [..., D]
        target_mean: torch.Tensor,  # [..., D]
        target_std: torch.Tensor,  # [..., D]
        offset: torch.Tensor | float = 0.0,  # [...] trajectory term
    ) -> torch.Tensor:
        """log r(x) [...] = log p~(x) - log q~(x)."""
        return gaussian_log_density(x, target_mean, target_std) - gaussian_log_density(x, draft_mean, draft_std) + offset

    def _finite_log_ratio(self, x, mq, sq, mp, sp, offset) -> torch.Tensor:
        """`accept_log_ratio` in float64 (float32 densities underflowed to -inf on both sides, and
        log r = -inf - (-inf) = NaN rejected a draft even where p == q); a NaN left over (inputs
        beyond float64's range too) is refused by name rather than judged. SYNC: one flag."""
        lr = self.accept_log_ratio(*(t.double() for t in (x, mq, sq, mp, sp)),
                                   offset.double() if isinstance(offset, torch.Tensor) else offset)
        if bool(torch.isnan(lr).any()):
            raise ValueError("the Gaussian densities of a draft underflowed even in float64 (log ratio NaN): means, "
                             "samples or standard deviations out of range (e.g. a temperature near 0)")
        return lr.to(x.dtype)  # the rule's working dtype (a float32 -1e40 becomes -inf: alpha 0, not NaN)

    def accept_log_ratio(self, x, draft_mean, draft_std, target_mean, target_std, offset=0.0) -> torch.Tensor:
        """The log ratio the accept / reject decision of a draft token uses: `log_ratio` here
        (exact); a relaxed rule overrides this only, so its residual stays the exact
        norm(max(0, p~ - q~))."""
        return self.log_ratio(x, draft_mean, draft_std, target_mean, target_std, offset)

    def sample_residual(
        self,
        draft_mean: torch.Tensor,  # [N, D]
        draft_std: torch.Tensor,  # [N, D]
        target_mean: torch.Tensor,  # [N, D]
        target_std: torch.Tensor,  # [N, D]
        offset: torch.Tensor,  # [N]
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Acceptance-rejection from norm(max(0, p~ - q~)) with proposal N(mu_p, sigma_p).
        -> (samples [N, D], fell_back [N] bool)."""
        N, D = target_mean.shape
        out = torch.empty_like(target_mean)
        found = torch.zeros(N, dtype=torch.bool, device=target_mean.device)
        done = 0
        while done < self.max_tries:  # fixed number of blocks: no data-dependent exit, no sync
            T = min(self.tries_per_block, self.max_tries - done)
            eps = draw(torch.randn, T, N, D, generator=generator, dtype=target_mean.dtype, device=target_mean.device)
            y = target_mean + target_std * eps  # [T, N, D]
            lr = self.log_ratio(y, draft_mean, draft_std, target_mean, target_std, offset)  # [T, N]
            keep_prob = (-torch.expm1(-lr)).clamp(0.0, 1.0)  # max(0, 1 - 1/r(y)), overflow-safe
            u = draw(torch.rand, T, N, generator=generator, dtype=target_mean.dtype, device=target_mean.device)
            ok = u < keep_prob
            first = ok.long().argmax(0)  # first success in this block (0 if none)
            any_ok = ok.any(0)
            take = any_ok & ~found
            out = torch.where(take.unsqueeze(-1), y[first, torch.arange(N, device=y.device)], out)
            found = found | any_ok
            done += T
        # Explicit fallback: a plain sample of the target's Gaussian, flagged and counted.
        eps = draw(torch.randn, N, D, generator=generator, dtype=target_mean.dtype, device=target_mean.device)
        out = torch.where(found.unsqueeze(-1), out, target_mean + target_std * eps)
        return out, ~found

    # -- verification -------------------------------------------------------------------

    def _check(self, draft_samples, draft_mean, draft_std, target_mean, target_std, draft_logstd_sum, target_logstd_sum, bonus):
        if not isinstance(draft_samples, torch.Tensor) or draft_samples.dim() != 3:
            raise ValueError(f"draft_samples must be a [B, K, D] tensor, got {getattr(draft_samples, 'shape', type(draft_samples))}")
        if not draft_samples.is_floating_point():
            raise ValueError(f"draft_samples must be floating point, got dtype {draft_samples.dtype}")
        B, K, D = draft_samples.shape
        want_t = (B, K + 1, D) if bonus else (B, K, D)
        for name, t, want in (
            ("draft_mean", draft_mean, (B, K, D)),
            ("draft_std", draft_std, (B, K, D)),
            ("target_mean", target_mean, want_t),
            ("target_std", target_std, want_t),
        ):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
                raise ValueError(f"{name} must have shape {list(want)}, got {tuple(getattr(t, 'shape', ()))}")
            if not t.is_floating_point():
                raise ValueError(f"{name} must be floating point, got dtype {t.dtype}")
        if (draft_logstd_sum is None) != (target_logstd_sum is None):
            raise ValueError("draft_logstd_sum and target_logstd_sum must be given together (or neither)")
        if draft_logstd_sum is not None:
            for name, t in (("draft_logstd_sum", draft_logstd_sum), ("target_logstd_sum", target_logstd_sum)):
                if not isinstance(t, torch.Tensor) or tuple(t.shape) not in ((B, K), (B, K, D)):
                    raise ValueError(f"{name} must have shape [B, K] or [B, K, D] = {[B, K, D]}, got {tuple(getattr(t, 'shape', ()))}")
            if not bool(torch.isfinite(draft_logstd_sum).all() & torch.isfinite(target_logstd_sum).all()):  # SYNC: validation
                raise ValueError("draft_logstd_sum and target_logstd_sum must be finite")
        if not bool((draft_std > 0).all() & torch.isfinite(draft_std).all()):  # SYNC: validation
            raise ValueError("draft_std must be finite and > 0 (a standard deviation, not a log-std)")
        if not bool((target_std > 0).all() & torch.isfinite(target_std).all()):  # SYNC: validation
            raise ValueError("target_std must be finite and > 0 (a standard deviation, not a log-std)")
        for name, t in (("draft_samples", draft_samples), ("draft_mean", draft_mean), ("target_mean", target_mean)):
            if not bool(torch.isfinite(t).all()):  # SYNC: validation
                raise ValueError(f"{name} must be finite")

    def accept_tokens(
        self,
        draft_samples: torch.Tensor,  # [B, K, D]
        draft_mean: torch.Tensor,  # [B, K, D]
        draft_std: torch.Tensor,  # [B, K, D]
        target_mean: torch.Tensor,  # [B, K, D]
        target_std: torch.Tensor,  # [B, K, D]
        *,
        draft_logstd_sum: torch.Tensor | None = None,  # [B, K] or [B, K, D]
        target_logstd_sum: torch.Tensor | None = None,  # [B, K] or [B, K, D]
        generator: torch.Generator | None = None,
        _checked: bool = False,
    ) -> ContinuousResult:
        """Judge every token independently (MAR's set-wise step); rejected tokens get a
        residual sample. `num_accepted` is still the leading run; `next_samples` is None."""
        if not _checked:
            self._check(draft_samples, draft_mean, draft_std, target_mean, target_std, draft_logstd_sum, target_logstd_sum, bonus=False)
        B, K, D = draft_samples.shape
        dtype = torch.float64 if draft_samples.dtype == torch.float64 else torch.float32
        x, mq, sq, mp, sp = (t.to(dtype) for t in (draft_samples, draft_mean, draft_std, target_mean, target_std))
        offset = self._offset(draft_logstd_sum, target_logstd_sum, x)  # [B, K]
        lr = self._finite_log_ratio(x, mq, sq, mp, sp, offset)
        alpha = torch.exp(lr.clamp(max=0.0))  # min(1, r)
        u = draw(torch.rand, B, K, generator=generator, dtype=dtype, device=x.device)
        accepted = u < alpha
        resid, fb = self.sample_residual(
            mq.reshape(-1, D), sq.reshape(-1, D), mp.reshape(-1, D), sp.reshape(-1, D), offset.reshape(-1), generator
        )
        resid, fb = resid.view(B, K, D), fb.view(B, K) & ~accepted
        samples = torch.where(accepted.unsqueeze(-1), x, resid)
        return ContinuousResult(
            num_accepted=accepted.long().cumprod(1).sum(1),
            next_samples=None,
            accepted=accepted,
            samples=samples,
            accept_probs=alpha,
            fallbacks=fb.long().sum(1),
            fell_back=fb,
        )

    def verify(
        self,
        draft_samples: torch.Tensor,  # [B, K, D]
        draft_mean: torch.Tensor,  # [B, K, D]
        draft_std: torch.Tensor,  # [B, K, D]
        target_mean: torch.Tensor,  # [B, K+1, D], position K gives the bonus token
        target_std: torch.Tensor,  # [B, K+1, D]
        *,
        draft_logstd_sum: torch.Tensor | None = None,  # [B, K] or [B, K, D]
        target_logstd_sum: torch.Tensor | None = None,  # [B, K] or [B, K, D]
        generator: torch.Generator | None = None,
    ) -> ContinuousResult:
        """Chain verification: keep the accepted prefix; `next_samples` is the residual sample
        at the first rejection, or a bonus sample N(mu_p,K, sigma_p,K) when all K pass.
        Only the residual at the first rejection is drawn."""
        self._check(draft_samples, draft_mean, draft_std, target_mean, target_std, draft_logstd_sum, target_logstd_sum, bonus=True)
        check_generator(generator)
        B, K, D = draft_samples.shape
        dtype = torch.float64 if draft_samples.dtype == torch.float64 else torch.float32
        x, mq, sq, mp, sp = (t.to(dtype) for t in (draft_samples, draft_mean, draft_std, target_mean, target_std))
        rows = torch.arange(B, device=x.device)
        bonus_eps = draw(torch.randn, B, D, generator=generator, dtype=dtype, device=x.device)
        bonus = mp[:, K] + sp[:, K] * bonus_eps
        if K == 0:
            empty = torch.zeros(B, 0, dtype=torch.bool, device=x.device)
            return ContinuousResult(
                torch.zeros(B, dtype=torch.long, device=x.device), bonus, empty, x, x.new_zeros(B, 0),
                torch.zeros(B, dtype=torch.long, device=x.device), empty,
            )
        offset = self._offset(draft_logstd_sum, target_logstd_sum, x)  # [B, K]
        lr = self._finite_log_ratio(x, mq, sq, mp[:, :K], sp[:, :K], offset)
        alpha = torch.exp(lr.clamp(max=0.0))
        u = draw(torch.rand, B, K, generator=generator, dtype=dtype, device=x.device)
        accepted = u < alpha
        num_accepted = accepted.long().cumprod(1).sum(1)
        at = num_accepted.clamp(max=K - 1)
        resid, fb = self.sample_residual(mq[rows, at], sq[rows, at], mp[rows, at], sp[rows, at], offset[rows, at], generator)
        full = num_accepted == K
        next_samples = torch.where(full.unsqueeze(-1), bonus, resid)
        fb = fb & ~full
        fell_back = torch.zeros(B, K, dtype=torch.bool, device=x.device)
        fell_back[rows, at] = fb
        samples = x.clone()
        samples[rows, at] = torch.where(full.unsqueeze(-1), x[rows, at], resid)
        return ContinuousResult(
            num_accepted=num_accepted,
            next_samples=next_samples,
            accepted=accepted,
            samples=samples,
            accept_probs=alpha,
            fallbacks=fb.long(),
            fell_back=fell_back,
        )
