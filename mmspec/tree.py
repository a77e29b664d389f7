"""Draft-tree bookkeeping and the sibling-by-sibling tree verification walk.

Trees are given per row as `parents[B, N]` (node index of the parent, -1 = the root, i.e.
the last committed token; parents precede children). Verify position 0 is the root and
draft node i sits at verify position i + 1.

`verify_tree` applies any `AcceptanceRule` to a tree the way SpecInfer (Miao et al. 2024,
arXiv 2305.09781) and EAGLE (Li et al. 2024, github.com/SafeAILab/EAGLE) do with
deterministic children: at the current node try its children in order; accept child x with
`rule.accept_probability(x, p, q)`; on rejection continue with `p <- rule.residual(x, p, q)`
and the next sibling; when no child is accepted draw the next token with `rule.sample(p)`.
Tree children are deterministic (top-k), so q is one-hot (None). The walk visits nodes in
index order, which is vectorised over the batch; a row only acts on nodes whose parent is
its current node.
"""

from __future__ import annotations

import torch

from mmspec.sampling import cached_arange, check_distributions, check_generator, draw, ids_in_range
from mmspec.types import Draft, Verdict


def chain_parents(batch: int, length: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Parents [B, K] of a chain: [-1, 0, 1, ..., K-2]."""
    return cached_arange(-1, length - 1, 1, device).unsqueeze(0).expand(batch, length)  # shared: read only


def ancestors(parents: torch.Tensor) -> torch.Tensor:
    """parents [B, N] -> visibility [B, N+1, N+1] bool over verify positions:
    `vis[b, i, j]` is True when position j is position i or one of its ancestors."""
    B, N = parents.shape
    device = parents.device
    pos_parent = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=device), parents.long() + 1], dim=1)
    eye = torch.eye(N + 1, dtype=torch.bool, device=device).expand(B, N + 1, N + 1)
    step = torch.zeros(B, N + 1, N + 1, dtype=torch.bool, device=device)
    step.scatter_(2, pos_parent.unsqueeze(-1), True)
    reach = (eye | step).to(torch.float32)
    # Pointer doubling: after t squarings reach covers paths of length 2**t.
    hops = 1
    while hops < N + 1:
        reach = (torch.bmm(reach, reach) > 0).to(torch.float32)
        hops *= 2
    return reach > 0


def depths(visibility: torch.Tensor) -> torch.Tensor:
    """visibility [B, N+1, N+1] -> depth [B, N+1] (root 0)."""
    return visibility.sum(-1) - 1


def parents_precede_children(parents: torch.Tensor) -> bool:
    """parents [B, N]: node i's parent is the root (-1) or an earlier node. SYNC."""
    N = parents.shape[-1]
    return not parents.numel() or bool(((parents >= -1) & (parents < torch.arange(N, device=parents.device))).all())


def verify_tree(
    rule,
    draft_tokens: torch.Tensor,  # [B, N]
    parents: torch.Tensor,  # [B, N], -1 = root
    target_probs: torch.Tensor,  # [B, N+1, V], position 0 = root
    *,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Walk the tree with `rule`; returns the accepted path of verify positions. The inputs are
    checked as a chain rule's `verify` checks them (token ids in the vocabulary, parents that
    precede their children, rows that are distributions): a direct caller's NaN row or logits
    came back as a verdict with NaN or negative distortion. The loop, whose inputs are well
    formed, calls `verify_tree_unchecked` (no host sync)."""
    if not isinstance(draft_tokens, torch.Tensor) or draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be a [B, N] tensor, got {getattr(draft_tokens, 'shape', type(draft_tokens))}")
    if draft_tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"draft_tokens must hold integer token ids, got dtype {draft_tokens.dtype}")
    B, N = draft_tokens.shape
    if not isinstance(parents, torch.Tensor) or tuple(parents.shape) != (B, N) or parents.is_floating_point():
        raise ValueError(f"parents must be an integer tensor of the shape of draft_tokens {(B, N)}, got "
                         f"{getattr(parents, 'dtype', type(parents))} {tuple(getattr(parents, 'shape', ()))}")
    if not isinstance(target_probs, torch.Tensor) or target_probs.dim() != 3 or tuple(target_probs.shape[:2]) != (B, N + 1):
        raise ValueError(f"target_probs must have shape [B, N+1, V] = [{B}, {N + 1}, V], got "
                         f"{tuple(getattr(target_probs, 'shape', ()))}")
    if not target_probs.is_floating_point() or target_probs.shape[2] == 0:
        raise ValueError(f"target_probs must be floating point probabilities over V >= 1 tokens, got "
                         f"{target_probs.dtype} with V = {target_probs.shape[2]}")
    check_generator(generator)
    V = target_probs.shape[2]
    if not ids_in_range(draft_tokens, V):  # SYNC: input validation
        raise ValueError(f"draft_tokens must lie in [0, V={V}); got values outside that range")
    if not parents_precede_children(parents):
        raise ValueError("parents[b, i] must be -1 (the root) or a node index < i (parents precede their children)")
    check_distributions("target_probs", target_probs)
    return verify_tree_unchecked(rule, draft_tokens, parents, target_probs, generator=generator)


def verify_tree_unchecked(rule, draft_tokens, parents, target_probs, *, generator=None) -> Verdict:
    """`verify_tree` without its input checks (the loop's well-formed inputs; the same arguments)."""
    B, N = draft_tokens.shape
    dtype = torch.float64 if target_probs.dtype == torch.float64 else torch.float32
    target_probs = target_probs.to(dtype)
    device = draft_tokens.device
    rows = torch.arange(B, device=device)
    cur = torch.zeros(B, dtype=torch.long, device=device)  # current verify position per row
    p = target_probs[:, 0].clone()
    path = torch.zeros(B, N + 1, dtype=torch.long, device=device)
    num_accepted = torch.zeros(B, dtype=torch.long, device=device)
    distortion = None
    tokens = draft_tokens.long()
    parent_pos = parents.long() + 1
    for i in range(N):
        x = tokens[:, i]
        is_child = parent_pos[:, i] == cur  # [B]
        if hasattr(rule, "accept_and_distortion"):
            alpha, d = rule.accept_and_distortion(x, p, None)
        else:
            alpha = rule.accept_probability(x, p, None)
            if hasattr(rule, "distortion_given"):
                d = rule.distortion_given(x, p, None, alpha)
            else:
                d = rule.distortion(x, p, None) if hasattr(rule, "distortion") else None
        if d is not None:
            contrib = torch.where(is_child, d, torch.zeros_like(d))
            distortion = contrib if distortion is None else distortion + contrib
        u = draw(torch.rand, B, generator=generator, dtype=dtype, device=device)
        take = is_child & (u < alpha)
        reject = is_child & ~take
        # Rejected sibling: continue at the same node with the rule's residual.
        p = torch.where(reject.unsqueeze(-1), rule.residual(x, p, None), p)
        # Accepted: move to the child; its own target distribution takes over.
        p = torch.where(take.unsqueeze(-1), target_probs[:, i + 1], p)
        cur = torch.where(take, torch.full_like(cur, i + 1), cur)
        num_accepted = num_accepted + take.long()
        path[rows, num_accepted] = torch.where(take, cur, path[rows, num_accepted])
    next_tokens = rule.sample(p, generator)
    # Pad the path after the last accepted position with that position.
    width = torch.arange(N + 1, device=device).unsqueeze(0)
    last = path[rows, num_accepted].unsqueeze(1)
    path = torch.where(width <= num_accepted.unsqueeze(1), path, last)
    return Verdict(path=path, num_accepted=num_accepted, next_tokens=next_tokens, distortion=distortion)


def chain_verify_name(rule) -> str:
    """The method the loop verifies a chain with: `verify_unchecked` (no validation, no host
    sync) where the rule has one, unless a `verify` written outside mmspec comes before it in the
    rule's method resolution order (a user subclass's or mixin's own `verify` would otherwise be
    skipped). The loop asks once per request."""
    own = vars(rule) if hasattr(rule, "__dict__") else {}
    if "verify_unchecked" in own:
        return "verify_unchecked"
    if "verify" in own:
        return "verify"
    mro = type(rule).__mro__
    unchecked = next((i for i, k in enumerate(mro) if "verify_unchecked" in vars(k)), None)
    checked = next((i for i, k in enumerate(mro) if "verify" in vars(k)), None)
    if unchecked is None or (checked is not None and checked < unchecked
                             and not str(mro[checked].__module__).startswith("mmspec.")):
        return "verify"
    return "verify_unchecked"


def verify_draft(
    rule,
    draft: Draft,
    target_probs: torch.Tensor,  # [B, N+1, V] processed target distributions, position 0 = root
    *,
    generator: torch.Generator | None = None,
    method: str | None = None,
) -> Verdict:
    """One verdict type for chains and trees: a chain goes through the rule's vectorised
    `verify` (its path is `arange`), a tree through `verify_tree`. Inside the loop the inputs
    are well formed, so a rule's optional `verify_unchecked` (no validation, no host sync) is
    used when it has one (see `mmspec.protocols.AcceptanceRule`); `method` names the one to
    call (`chain_verify_name(rule)`, which the loop reads once per request)."""
    if not draft.is_chain:
        return verify_tree_unchecked(rule, draft.tokens, draft.parents, target_probs, generator=generator)
    B, N = draft.tokens.shape
    res = getattr(rule, method or chain_verify_name(rule))(draft.tokens, draft.draft_probs, target_probs,
                                                          generator=generator)
    if not (hasattr(res, "num_accepted") and hasattr(res, "next_tokens")):  # (a rule written outside mmspec)
        raise TypeError(f"{type(rule).__name__}.verify must return a mmspec.types.AcceptanceResult, got "
                        f"{type(res).__name__}")
    path = cached_arange(0, N + 1, 1, draft.tokens.device).expand(B, N + 1)
    return Verdict(path=path, num_accepted=res.num_accepted, next_tokens=res.next_tokens, distortion=res.distortion)
