"""Relaxed CSpD acceptance: the final-step Gaussians widened by an "inner temperature" in the
accept test (lossy; what CSpD's public code runs by default).

Source: Wang et al., "Continuous Speculative Decoding for Autoregressive Image Generation"
(arXiv 2411.11925); public code github.com/MarkXCloud/CSpD, `spec_decode/spec_decode_runner.py`,
whose `SpecDecodeRunner(inner_temperature=42.)` divides both Gaussians' standardised
deviations by 42 before it compares them. The paper's text describes the exact test
(`ContinuousAcceptance`); this file makes the public code's relaxation available, named and
flagged as lossy, so the two can be measured side by side.

Why it exists (measured on the testbed MAR pair of `mmspec testbed train-mar`, 8 latent dims,
25 head steps): the last denoising step of MAR's diffusion head has a tiny standard deviation
(about sqrt(beta_1) of the cosine schedule times the temperature, 0.0064 there), while two
different models that denoise the same aligned noise end their trajectories about 0.1 apart,
16 standard deviations per dimension. The exact ratio p(x) / q(x) is then ~1e-38: no draft
token is ever accepted, whatever the drafter. Widening both Gaussians by tau shrinks the
exponents by tau^2: at tau = 42 the same tokens are accepted 37% of the time (tau = 16: 6%).

The rule. With p = N(mu_p, sigma_p^2) and q = N(mu_q, sigma_q^2) the two final-step Gaussians,

    log r_tau(x) = log N(x; mu_p, (tau sigma_p)^2) - log N(x; mu_q, (tau sigma_q)^2)   (+ trajectory term)

(the log tau normalisers cancel), a draft token x ~ q is kept with probability min(1, r_tau(x)),
and a rejected one is replaced by a sample of the *exact* residual norm(max(0, p - q)), by the
same bounded acceptance-rejection as `ContinuousAcceptance` (counted fallbacks). With equal
stds r_tau = r^(1 / tau^2), so every draft token is kept at least as often as by the exact
rule. tau = 1 is the exact rule (and then `lossless` is True).

What it costs: a kept draft token is the drafter's sample, so the images move from the
target's distribution towards the drafter's; how far is a measurement (`mmspec bench mar`
reports judge class accuracy and Frechet for plain, exact and relaxed CSpD), not a guarantee.
Deviation from the public code: it multiplies the tempered exponent ratio by
prod(sigma_p / sigma_q) (and passes variances where stds are expected); we keep the Gaussian
normalisers prod(sigma_q / sigma_p). MAR's learned-sigma heads give both models nearly the
same last-step std, so the two differ little in practice.
"""

from __future__ import annotations

import math

import torch

from .continuous import ContinuousAcceptance, gaussian_log_density
from mmspec.sampling import plain_number


class RelaxedContinuousAcceptance(ContinuousAcceptance):
    """CSpD verification with the accept test's Gaussians widened by `inner_temperature`
    (lossy unless it is 1); the residual of a rejected token stays exact."""

    name = "continuous-relaxed"

    def __init__(self, inner_temperature: float = 42.0, max_tries: int = 64, tries_per_block: int = 16) -> None:
        super().__init__(max_tries=max_tries, tries_per_block=tries_per_block)
        inner_temperature = plain_number(inner_temperature)
        if isinstance(inner_temperature, bool) or not isinstance(inner_temperature, (int, float)) \
                or not math.isfinite(inner_temperature) or inner_temperature < 1.0:
            raise ValueError(f"inner_temperature must be a finite number >= 1 (1 is the exact rule), got {inner_temperature!r}")
        self.inner_temperature = float(inner_temperature)

    @property
    def lossless(self) -> bool:  # type: ignore[override]
        return self.inner_temperature == 1.0

    def accept_log_ratio(self, x, draft_mean, draft_std, target_mean, target_std, offset=0.0) -> torch.Tensor:
        tau = self.inner_temperature
        return (gaussian_log_density(x, target_mean, target_std * tau)
                - gaussian_log_density(x, draft_mean, draft_std * tau) + offset)

    def __repr__(self) -> str:
        return f"RelaxedContinuousAcceptance(inner_temperature={self.inner_temperature:g})"
