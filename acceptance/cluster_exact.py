"""Cluster-exact speculative sampling over static, disjoint token clusters (the GSD variant
suggested in docs/algorithms.md section 3; GSD: So et al., arXiv 2508.07747,
github.com/junhyukso/GSD).

Give every vocabulary entry a cluster label (e.g. k-means over VQ codes). With cluster masses
P(c) = sum_{y in c} p(y) and Q(c) = sum_{y in c} q(y), run exact speculative sampling on the
clusters and then pick the token inside the chosen cluster:

    accept x with probability min(1, P(c(x)) / Q(c(x)))         (Leviathan et al. eq. 1 on clusters)
    on rejection: cluster c ~ norm(max(P - Q, 0)), token y ~ p(. | c) = p(y) / P(c)

A one-hot draft has Q = one_hot(c(x)): alpha = P(c(x)) and the residual is p with the whole
cluster of x removed.

In which sense it is exact: conditioned on everything emitted before, the *cluster* of the
emitted token is distributed exactly as under p (the usual speculative-sampling argument
applied to P and Q). The token inside the cluster is not: an accepted draft keeps the
drafter's within-cluster choice q(. | c), a resampled one follows p(. | c). Because later
positions are conditioned on the actual tokens, sequences of clusters over several steps are
exact only when p's cluster marginals do not depend on the within-cluster choice.
A draft the target gives probability 0 (one top-k / top-p removed) is accepted with P(c(x))
like any other member of its cluster (counted in the distortion).
Trees: rejecting a child removes its cluster, so a sibling of the same cluster is never
accepted after it (SpecInfer on clusters).

Distortion (token level, per candidate, exact): the step's output differs from p only
inside clusters, by TVD = sum_c min(P(c), Q(c)) * TV(q(. | c), p(. | c)); for a one-hot draft
this is P(c(x)) - p(x).
"""

from __future__ import annotations

import torch

from .base import ChainRule
from .exact import capped_ratio
from mmspec.sampling import normalize


class ClusterExactAcceptance(ChainRule):
    """Speculative sampling that is exact at the level of static clusters `labels` [V]."""

    lossless = False
    name = "cluster_exact"

    def __init__(self, labels: torch.Tensor) -> None:
        if not isinstance(labels, torch.Tensor) or labels.dim() != 1:
            raise ValueError(f"labels must be a [V] tensor of cluster ids, got {getattr(labels, 'shape', type(labels))}")
        if labels.is_floating_point() or labels.dtype == torch.bool:
            raise ValueError(f"labels must hold integer cluster ids, got dtype {labels.dtype}")
        if labels.numel() == 0:
            raise ValueError("labels must have one entry per vocabulary token, got an empty tensor")
        if int(labels.min()) < 0:  # SYNC: validation
            raise ValueError("labels must be >= 0")
        # Cluster ids are names: renumbered 0..C-1 (in id order), so an id like 2**40 costs no
        # [M, 2**40] mass table (it was a 4.4 TB allocation on the first call).
        ids, self.labels = torch.unique(labels.long(), return_inverse=True)
        self.num_clusters = int(ids.numel())
        self.vocab_size = labels.numel()

    def _labels(self, p: torch.Tensor) -> torch.Tensor:
        if p.shape[-1] != self.vocab_size:
            raise ValueError(f"p has V={p.shape[-1]} entries but labels has {self.vocab_size}")
        if self.labels.device != p.device:
            self.labels = self.labels.to(p.device)
        return self.labels

    def cluster_mass(self, dist: torch.Tensor) -> torch.Tensor:
        """dist [M, V] -> mass per cluster [M, C]."""
        lab = self._labels(dist).expand_as(dist)
        return dist.new_zeros(dist.shape[0], self.num_clusters).scatter_add_(-1, lab, dist)

    def _masses(self, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None):
        lab = self._labels(p)
        P = self.cluster_mass(p)
        cx = lab[x]  # [M]
        if q is None:
            Q = torch.nn.functional.one_hot(cx, self.num_clusters).to(p.dtype)
        else:
            Q = self.cluster_mass(q)
        return P, Q, cx

    def accept_probability(self, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
        P, Q, cx = self._masses(x, p, q)
        Pc = P.gather(-1, cx.unsqueeze(-1)).squeeze(-1)
        Qc = Q.gather(-1, cx.unsqueeze(-1)).squeeze(-1)
        # (a floor under Q(c) before dividing skewed denormal masses: 1e-39 / 1e-40 gave 0.085)
        return capped_ratio(Pc, Qc)

    def residual(self, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
        P, Q, _ = self._masses(x, p, q)
        R = normalize((P - Q).clamp_min(0.0), P)  # residual over clusters [M, C]
        lab = self._labels(p).expand_as(p)
        Py = P.gather(-1, lab)  # P(c(y)) [M, V]
        within = torch.where(Py > 0, p / Py.clamp_min(torch.finfo(p.dtype).tiny), torch.zeros_like(p))
        return normalize(R.gather(-1, lab) * within, p)

    def distortion(self, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
        P, Q, cx = self._masses(x, p, q)
        lab = self._labels(p).expand_as(p)
        tiny = torch.finfo(p.dtype).tiny
        Py = P.gather(-1, lab)
        p_in = torch.where(Py > 0, p / Py.clamp_min(tiny), torch.zeros_like(p))
        if q is None:
            q_in = torch.zeros_like(p).scatter(-1, x.unsqueeze(-1), 1.0)
        else:
            Qy = Q.gather(-1, lab)
            q_in = torch.where(Qy > 0, q / Qy.clamp_min(tiny), torch.zeros_like(q))
        tv = 0.5 * torch.zeros_like(P).scatter_add_(-1, lab, (q_in - p_in).abs())  # TV per cluster [M, C]
        # A cluster where one side has no mass contributes min(P, Q) = 0.
        return (torch.minimum(P, Q) * tv).sum(-1)
