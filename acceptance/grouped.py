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

Limits: lossy. A draft the target gives probability 0 (one top-k / top-p removed) can be
accepted on its cluster's mass, as in the public code (counted in the distortion). The distortion reported per candidate is the over-accepted mass at x,
`max(0, q(x) * alpha - p(x))`, which is the whole total-variation distance of the step for a
one-hot draft; for sampled drafts the other tokens' over-acceptance is not included (it
would need one cluster per vocabulary entry). Cost per candidate: one sort of p ([V]) and a
gather of `window` embeddings. For p in float32 or narrower the window comes from two
top-k over an exact integer key instead of the sort, and for codebooks of <= 1024 codes the
distances from a table computed once (both give the same clusters; tested against a
transcription of the rule).
"""

from __future__ import annotations

import torch

from .base import ChainRule
from .exact import capped_ratio, exact_residual
from mmspec.sampling import plain_number


# Squared-distance tables of small codebooks, by embedding tensor (identity, shape, in-place
# version): the few models of a process, each computed once.
_D2_TABLES: dict = {}


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
        if not bool(torch.isfinite(embeddings).all()):  # NaN distances silently emptied every cluster
            raise ValueError("embeddings hold NaN or inf entries; pass the model's finite token embeddings")
        window, prob_threshold = plain_number(window), plain_number(prob_threshold)
        distance_threshold = plain_number(distance_threshold)
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1 (tokens around x's rank), got {window!r}")
        # `not x >= 0` also refuses NaN, which compared False everywhere (an exact rule in disguise);
        # an infinite distance threshold is meaningful (no embedding-distance test) and kept
        if isinstance(prob_threshold, bool) or not isinstance(prob_threshold, (int, float)) or not prob_threshold >= 0:
            raise ValueError(f"prob_threshold must be a number >= 0, got {prob_threshold!r}")
        if (isinstance(distance_threshold, bool) or not isinstance(distance_threshold, (int, float))
                or not distance_threshold >= 0):
            raise ValueError(f"distance_threshold must be a number >= 0 (inf: no distance test), got "
                             f"{distance_threshold!r}")
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
        if p.element_size() <= 4 and V < 2 ** 31:
            tokens, inside = self._window_by_key(x, p)
        else:
            order = torch.sort(p, dim=-1, stable=True).indices  # ascending, ties by token id
            ids = torch.arange(V, device=p.device).unsqueeze(0)
            rank = ((p < px) | ((p == px) & (ids < x.unsqueeze(-1)))).sum(-1)  # x's place in `order`
            pos = rank.unsqueeze(-1) - self.window // 2 + torch.arange(self.window, device=p.device)
            inside = (pos >= 0) & (pos < V)
            tokens = order.gather(-1, pos.clamp(0, V - 1))  # [M, W]
        pw = p.gather(-1, tokens)
        d2 = self._distances(x, tokens, emb)  # ||e_w - e_x||^2, [M, W]
        member = inside & ((pw - px).abs() < self.prob_threshold) & (d2 < self.distance_threshold)
        # x itself always belongs (its own rank is inside the window, distance 0).
        member = member | (tokens == x.unsqueeze(-1)) & inside
        return tokens, member

    def _window_by_key(self, x: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The same rank window without sorting p (a sort of [M, V] dominated the rule's cost):
        for p >= 0 in at most 32 bits, the bits of p read as an integer rise with p, so
        key = bits * V + id orders the vocabulary exactly like (p, id); the window is then the
        `window // 2` largest keys below x's, x, and the smallest keys above it (two top-k)."""
        M, V = p.shape
        bits = (p.float() + 0.0).view(torch.int32).to(torch.int64)  # exact in float32; + 0.0 turns -0.0 into 0.0
        key = bits * V + torch.arange(V, device=p.device)
        kx = key.gather(-1, x.unsqueeze(-1))
        n_lo, n_hi = self.window // 2, self.window - self.window // 2 - 1
        big = torch.iinfo(torch.int64).max
        parts, ok = [], []
        if n_lo:
            lo = torch.where(key < kx, key, -1).topk(min(n_lo, V), dim=-1).values.flip(-1)  # ascending
            lo = torch.cat([lo.new_full((M, n_lo - lo.shape[1]), -1), lo], -1)
            parts.append(lo)
            ok.append(lo >= 0)
        parts.append(kx)
        ok.append(torch.ones_like(kx, dtype=torch.bool))
        if n_hi:
            hi = torch.where(key > kx, key, big).topk(min(n_hi, V), dim=-1, largest=False).values
            hi = torch.cat([hi, hi.new_full((M, n_hi - hi.shape[1]), big)], -1)
            parts.append(hi)
            ok.append(hi < big)
        keys, inside = torch.cat(parts, -1), torch.cat(ok, -1)
        return torch.where(inside, keys % V, 0), inside

    def _distances(self, x: torch.Tensor, tokens: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """||e_w - e_x||^2 for the window, from a [V, V] table when the vocabulary is small
        (<= 1024 codes: at most 4 MiB, computed once per device), else (or for embeddings made
        under inference_mode) from the embeddings."""
        from mmspec.versions import version_of  # (at call time: rules import only a few core modules)

        V = emb.shape[0]
        version = version_of(emb)  # None: an inference tensor, whose in-place edits cannot be seen
        if V > 1024 or version is None:
            return (emb[tokens] - emb[x].unsqueeze(1)).pow(2).sum(-1)
        key = (emb.data_ptr(), tuple(emb.shape), emb.dtype, str(emb.device), version)
        hit = _D2_TABLES.get(key)
        if hit is None:  # a rule named by string is built per call: the table outlives it
            table = torch.stack([(emb - emb[i]).pow(2).sum(-1) for i in range(V)])
            while len(_D2_TABLES) >= 4:
                _D2_TABLES.pop(next(iter(_D2_TABLES)))
            # The entry holds the embedding tensor itself, so its memory cannot be freed and
            # reused by another tensor under the same key; an in-place edit changes _version.
            hit = _D2_TABLES[key] = (emb, table)
        return hit[1][x.unsqueeze(1), tokens]

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
