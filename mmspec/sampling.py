"""Turning logits into the distributions speculative decoding compares.

Target and drafter logits go through the same processing (temperature, top-k, top-p), so
`p` and `q` (docs/algorithms.md) are always the *processed* distributions; this is what makes
exact speculative sampling distributed like plain sampling with the same settings. The
math runs in float32 or wider (float64 models stay float64).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are drawn. `temperature == 0` means greedy."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {self.temperature!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be None or an int >= 1, got {self.top_k!r}")
        if self.top_p is not None and not (0.0 < float(self.top_p) <= 1.0):
            raise ValueError(f"top_p must be None or in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def process_logits(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] after temperature, top-k and top-p.

    With `temperature == 0` the result is the one-hot of the argmax (ties to the lowest id,
    like `torch.argmax`), which keeps greedy decoding a special case of the same code."""
    x = logits.to(_math_dtype(logits.dtype))
    if config.greedy:
        return torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).to(x.dtype)
    x = x / config.temperature
    if config.top_k is not None and config.top_k < x.shape[-1]:
        kth = torch.topk(x, config.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if config.top_p is not None and config.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = sorted_x.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= config.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x.softmax(-1)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """probs [B, V] -> tokens [B].

    Rows that are not a distribution (NaN / inf / negative) are sampled uniformly instead of
    letting `torch.multinomial` abort mid-step; the loop checks every distribution inside the
    step's one host sync and raises a ValueError naming the culprit, so nothing sampled from
    such a row is ever emitted."""
    bad = ~(torch.isfinite(probs) & (probs >= 0)).all(-1, keepdim=True)
    probs = torch.where(bad, torch.ones_like(probs), probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def normalize(weights: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Normalise non-negative weights [B, V] row-wise; rows whose mass is (numerically)
    zero take `fallback` [B, V] instead, so a degenerate residual (p == q) never yields NaN."""
    mass = weights.sum(-1, keepdim=True)
    ok = mass > torch.finfo(weights.dtype).tiny * weights.shape[-1] * 16
    return torch.where(ok, weights / mass.clamp_min(torch.finfo(weights.dtype).tiny), fallback)
