"""`grow_tree`: the EAGLE-2 dynamic draft tree of a feature-level head (Li et al. 2024, EAGLE-2,
arXiv 2406.16858, section 4; github.com/SafeAILab/EAGLE): expand the `top_k` best children of
the `top_k` best frontier nodes for `depth` levels, ranked by cumulative draft log-prob, then keep
the best `num_nodes` nodes of the whole tree (closed under ancestors). Used by `EagleHeadDrafter`
(and the ViSpec drafter built on it) and `ModelDrafter` (over its runner).
"""

from __future__ import annotations

from typing import Callable

import torch

from mmspec.sampling import SamplingConfig, process_logits
from mmspec.types import Draft, TreeConfig


def grow_tree(root_logits: torch.Tensor, cfg: TreeConfig, expand: Callable, num_nodes: int | None = None,
              score_dtype: torch.dtype = torch.float64, *, noise: torch.Tensor | None = None,
              sampling: SamplingConfig | None = None) -> Draft:
    """EAGLE-2 dynamic tree. `expand(frontier_tokens [B,k], parent_slot [B,k] | None, level,
    visibility [B,k,R+k], region R) -> logits [B,k,V]` runs the frontier through the drafter
    (parent_slot: which previous frontier node each one hangs under; None at level 1).
    `num_nodes` (default `cfg.num_nodes`): how many of the best nodes to keep (an adaptive tree's
    choice of the step). `score_dtype`: the dtype of the cumulative log-probs (`ModelDrafter`
    ranks in float32, the EAGLE heads in float64).

    `noise` (acceptance="invariant": the loop's race noise E [B, depth, V] of the positions the
    tree's levels stand for) with `sampling`: the levels rank ``log_softmax(log q - log E)`` of the
    processed draft distribution q instead of ``log_softmax`` of the raw logits (Gumbel top-k,
    renormalised so that scores fall along every path), so each level's
    best child is the chain's Gumbel-max draft and its siblings the next-best perturbed guesses at
    the token the verifier's perturbed argmax will pick."""
    k = cfg.top_k
    B = root_logits.shape[0]
    device = root_logits.device
    rows = torch.arange(B, device=device).unsqueeze(1)

    def log_q(logits: torch.Tensor, level: int) -> torch.Tensor:
        if noise is None:
            return torch.log_softmax(logits.to(score_dtype), -1)
        g = -torch.log(noise[:, level].to(score_dtype))  # [B, V]
        # Normalised again, so scores only fall along a path and the kept set stays closed under ancestors.
        perturbed = process_logits(logits, sampling).to(score_dtype).log() + (g if logits.dim() == 2 else g.unsqueeze(1))
        return torch.log_softmax(perturbed, -1)

    scores, toks = log_q(root_logits, 0).topk(k, -1)
    pool_tokens, pool_scores, pool_parents, pool_depth = [toks], [scores], [torch.full_like(toks, -1)], [0]
    frontier_idx = torch.arange(k, device=device).expand(B, k)
    frontier_tokens, frontier_scores, parent_slot = toks, scores, None
    parent_vis = torch.zeros(B, k, 0, dtype=torch.bool, device=device)
    region, pool_size = 0, k
    for level in range(1, cfg.depth):
        vis = torch.cat([parent_vis, torch.eye(k, dtype=torch.bool, device=device).expand(B, k, k)], 2)
        logits = expand(frontier_tokens, parent_slot, level, vis, region)
        region += k
        cand = frontier_scores.unsqueeze(-1) + log_q(logits, level)
        c_scores, c_toks = cand.topk(k, -1)
        c_parent = frontier_idx.unsqueeze(-1).expand(B, k, k)
        c_scores, c_toks, c_parent = (t.reshape(B, k * k) for t in (c_scores, c_toks, c_parent))
        pool_tokens.append(c_toks)
        pool_scores.append(c_scores)
        pool_parents.append(c_parent)
        pool_depth.append(level)
        best_scores, best = c_scores.topk(k, -1)
        parent_slot = best // k
        parent_vis = vis[rows, parent_slot]
        frontier_idx, frontier_tokens, frontier_scores = pool_size + best, c_toks.gather(1, best), best_scores
        pool_size += k * k
    tokens, parents = torch.cat(pool_tokens, 1), torch.cat(pool_parents, 1)
    depth_pen = torch.cat([torch.full_like(s, d) for s, d in zip(pool_scores, pool_depth)], 1)
    scores = torch.cat(pool_scores, 1) - 1e-6 * depth_pen  # ties: shallower first (closed under ancestors)
    n = min(cfg.num_nodes if num_nodes is None else num_nodes, tokens.shape[1])
    keep = scores.topk(n, -1).indices.sort(-1).values
    inverse = torch.full_like(tokens, -1)
    inverse[rows, keep] = torch.arange(n, device=device).expand(B, n)
    kept = parents.gather(1, keep)
    new_parents = torch.where(kept >= 0, inverse.gather(1, kept.clamp_min(0)), kept)
    return Draft(tokens=tokens.gather(1, keep), parents=new_parents, draft_probs=None, is_chain=False,
                 depth=min(cfg.depth, n))
