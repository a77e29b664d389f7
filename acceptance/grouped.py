"""Grouped speculative decoding, GSD (So et al., ICCV 2025, arXiv 2508.07747; public code:
github.com/junhyukso/GSD, `scheduler/jacobi_iteration_lumina_mgpt.py`, class
`SpeculativeSampler.__call__`).

Training-free relaxation for image-token drafts (typically Speculative Jacobi Decoding).
At a draft x the target's processed distribution p is ranked and x is judged together with
a dynamic cluster of look-alike tokens (docs/algorithms.md section 3):

    order  = tokens sorted by p, ascending, ties by token id  (the public code sorts the
             processed logits ascending; the order is the same)
    r      = rank of x in that order
    W      = order[r - window//2 : r - window//2 + window]      (public: [r-7 : r+7]),
             cut at both ends of the vocabulary
    G(x)   = { w in W : |p(w) - p(x)| < prob_threshold  and  ||e_w - e_x||^2 < distance_threshold }
    alpha  = min(1, sum_G p / sum_G q)                           (x is always in G)

where `e` are the AR model's input token embeddings (raw, not normalised, as in the public
code). On rejection the next token comes from norm(max(p - q, 0)), the exact residual.
A deterministic drafter (SJD's random initial tokens, trees) has q = one_hot(x), so
sum_G q = 1 and alpha = min(1, sum_G p).

Differences from the public code, on purpose: near the bottom of the ranking (r < 7) the
public slice is empty and an exception makes it fall back to the per-token ratio; here the
window is simply cut at rank 0 (those tokens have p ~ 0 after top-k, so the outcome rarely
differs). The public code skips the distance test when the window holds a non-image token
id (> 10000, Lumina-mGPT specific); here the caller decides which embeddings to pass.
`window=1` gives exact speculative sampling.

For one-hot drafts sum_G p >= p(x), so GSD never accepts less often than exact sampling.
With sampled drafts a cluster whose q outweighs its p can lower a candidate's ratio below
p(x)/q(x); GSD then accepts more often only on average, on problems with look-alike tokens.

Limits: lossy. The distortion reported per candidate is the over-accepted mass at x,
`max(0, q(x) * alpha - p(x))`, which is the whole total-variation distance of the step for a
one-hot draft; for sampled drafts the other tokens' over-acceptance is not included (it
would need one cluster per vocabulary entry). Cost per candidate: one sort of p ([V]) and a
gather of `window` embeddings.
"""

from __future__ import annotations

import torch

from .base import ChainRule
from .exact import capped_ratio, exact_residual


class GroupedAcceptance(ChainRule):
    """GSD: accept a draft token if its dynamic cluster of look-alike tokens is likely enough.
    `embeddings` [V, D] are the target's input token embeddings; defaults are the public
    code's (window 14, |dp| < 0.15, squared distance < 0.5)."""

    lossless = False
    name = "gsd"

    def __init__(
        self,
        embeddings: torch.Tensor,
        window: int = 14,
        prob_threshold: float = 0.15,
        distance_threshold: float = 0.5,
    ) -> None:
        if not isinstance(embeddings, torch.Tensor) or embeddings.dim() != 2:
            raise ValueError(f"embeddings must be a [V, D] tensor, got {getattr(embeddings, 'shape', type(embeddings))}")
        if not embeddings.is_floating_point():
            raise ValueError(f"embeddings must be floating point, got dtype {embeddings.dtype}")
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1 (tokens around x's rank), got {window!r}")
        if not isinstance(prob_threshold, (int, float)) or float(prob_threshold) < 0:
            raise ValueError(f"prob_threshold must be >= 0, got {prob_threshold!r}")
        if not isinstance(distance_threshold, (int, float)) or float(distance_threshold) < 0:
            raise ValueError(f"distance_threshold must be >= 0, got {distance_threshold!r}")
        self.embeddings = embeddings.detach().to(torch.float32)
        self.window = window
        self.prob_threshold = float(prob_threshold)
        self.distance_threshold = float(distance_threshold)
        self.vocab_size = embeddings.shape[0]

    def cluster(self, x: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M], p [M, V] -> (tokens [M, window] of the rank window, in_cluster [M, window] bool).
        Positions outside the vocabulary are marked False (their token id is clamped)."""
        M, V = p.shape
        if V != self.vocab_size:
            raise ValueError(f"p has V={V} entries but embeddings has {self.vocab_size} rows")
        emb = self.embeddings
        if emb.device != p.device:
            emb = emb.to(p.device)
            self.embeddings = emb
        px = p.gather(-1, x.unsqueeze(-1))  # [M, 1]
        order = torch.sort(p, dim=-1, stable=True).indices  # ascending, ties by token id
        ids = torch.arange(V, device=p.device).unsqueeze(0)
        rank = ((p < px) | ((p == px) & (ids < x.unsqueeze(-1)))).sum(-1)  # x's place in `order`
        pos = rank.unsqueeze(-1) - self.window // 2 + torch.arange(self.window, device=p.device)
        inside = (pos >= 0) & (pos < V)
        tokens = order.gather(-1, pos.clamp(0, V - 1))  # [M, W]
        pw = p.gather(-1, tokens)
        d2 = (emb[tokens] - emb[x].unsqueeze(1)).pow(2).sum(-1)  # ||e_w - e_x||^2, [M, W]
        member = inside & ((pw - px).abs() < self.prob_threshold) & (d2 < self.distance_threshold)
        # x itself always belongs (its own rank is inside the window, distance 0).
        member = member | (tokens == x.unsqueeze(-1)) & inside
        return tokens, member

    def accept_probability(self, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
        tokens, member = self.cluster(x, p)
        w = member.to(p.dtype)
        group_p = (p.gather(-1, tokens) * w).sum(-1)
        if q is None:
            group_q = torch.ones_like(group_p)  # one-hot draft: only x carries q mass
        else:
            group_q = (q.gather(-1, tokens) * w).sum(-1)
        return capped_ratio(group_p, group_q)

    def residual(self, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
        return exact_residual(x, p, q)

    def distortion(self, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
        return self.distortion_given(x, p, q, self.accept_probability(x, p, q))

    def distortion_given(self, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None,
                         alpha: torch.Tensor) -> torch.Tensor:
        # The cluster (a sort of p per candidate) is computed once per step, in accept_probability.
        px = p.gather(-1, x.unsqueeze(-1)).squeeze(-1)
        qx = torch.ones_like(px) if q is None else q.gather(-1, x.unsqueeze(-1)).squeeze(-1)
        return (qx * alpha - px).clamp_min(0.0)
