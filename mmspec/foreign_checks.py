"""Checks on what code written outside mmspec hands the loop: a drafter's `Draft`, a rule's
verdict, a target's `TargetOutput`. mmspec's own drafters, rules and targets (and user subclasses
that keep their methods) are trusted and pay nothing; a method written elsewhere is checked each
time it returns, before its output reaches a place where a mistake failed as a raw IndexError
or AttributeError deep in the loop (a CUDA device-side assert on the GPU), or, for a drafter's
distributions, passed silently and made exact sampling draw from another law. Token ids and
counts are read on the CPU only, where the read costs no sync."""

from __future__ import annotations

import torch

from mmspec.sampling import check_distributions, ids_in_range
from mmspec.tree import parents_precede_children
from mmspec.types import Draft, TargetOutput


def written_outside(obj, method: str) -> bool:
    """Whether `obj.method` (bound, or set on the instance) was written outside the mmspec package."""
    func = getattr(obj, method, None)
    func = getattr(func, "__func__", func)
    return not str(getattr(func, "__module__", "") or "").startswith("mmspec.")


def check_draft(draft, rows: int, vocab: int, on_host: bool, drafter) -> None:
    """A `propose` written outside mmspec: its Draft's types and shapes, at most the drafter's
    `max_draft_nodes` nodes, and (on the CPU) the token range, a chain's or a tree's parents and
    the draft distributions: rows that are distributions, chains only, giving each drafted token
    a positive probability (otherwise exact sampling emitted from another law, silently)."""
    name = type(drafter).__name__
    if not isinstance(draft, Draft):
        raise TypeError(f"{name}.propose must return a mmspec.types.Draft, got {type(draft).__name__}")
    for field in ("tokens", "parents"):
        t = getattr(draft, field)
        if not isinstance(t, torch.Tensor) or t.dtype != torch.long or t.dim() != 2 or t.shape[0] != rows:
            raise ValueError(f"{name}.propose returned Draft.{field} of {getattr(t, 'dtype', type(t))} "
                             f"{tuple(getattr(t, 'shape', ()))}; it must be a torch.long tensor [{rows} active rows, N]")
    if draft.parents.shape != draft.tokens.shape:
        raise ValueError(f"{name}.propose returned Draft.parents {tuple(draft.parents.shape)} for tokens "
                         f"{tuple(draft.tokens.shape)}; they must have the same shape")
    most = getattr(drafter, "max_draft_nodes", None)
    if isinstance(most, int) and draft.tokens.shape[1] > most:
        raise ValueError(f"{name}.propose returned {draft.tokens.shape[1]} draft nodes per row, more than its "
                         f"max_draft_nodes={most} (the room the target keeps for a step's drafts); raise "
                         "max_draft_nodes or draft fewer")
    q = draft.draft_probs
    if q is not None and (not isinstance(q, torch.Tensor) or tuple(q.shape) != (*draft.tokens.shape, vocab)):
        raise ValueError(f"{name}.propose returned Draft.draft_probs {tuple(getattr(q, 'shape', ()))}; it must be "
                         f"None or [{rows}, {draft.tokens.shape[1]}, {vocab}] (one distribution per drafted token)")
    if not on_host:
        return
    if not ids_in_range(draft.tokens, vocab):
        raise ValueError(f"{name}.propose drafted token ids outside the target's vocabulary 0..{vocab - 1} "
                         f"(min {int(draft.tokens.min())}, max {int(draft.tokens.max())})")
    if not draft.is_chain and not parents_precede_children(draft.parents):
        raise ValueError(f"{name}.propose returned a tree whose parents[b, i] are not all -1 (the root) or a node "
                         f"index < i (parents precede their children)")
    if draft.is_chain and not torch.equal(draft.parents, torch.arange(-1, draft.parents.shape[1] - 1).expand_as(
            draft.parents)):
        raise ValueError(f"{name}.propose returned is_chain=True with parents that are not a chain's [-1, 0, 1, ...]; "
                         "return is_chain=False for a tree")
    if q is None:
        return
    if not draft.is_chain:
        raise ValueError(f"{name}.propose returned draft_probs with a tree: a tree's nodes are taken as chosen "
                         "deterministically (mmspec.types.Draft); draft_probs are for chains only")
    check_distributions(f"{name}.propose's Draft.draft_probs (the distributions the drafts were drawn from)", q)
    if not bool((q.gather(-1, draft.tokens.unsqueeze(-1)) > 0).all()):
        raise ValueError(f"{name}.propose drafted tokens to which its own draft_probs give probability 0; a draft "
                         "must be drawn from the distribution returned with it (or return draft_probs=None for "
                         "deterministic drafts)")


def check_verdict(verdict, rows: int, nodes: int, vocab: int, on_host: bool, rule) -> None:
    """A rule whose `verify` was written outside mmspec: `num_accepted` / `next_tokens` long
    tensors [rows] and, on the CPU, 0 <= num_accepted <= nodes and next tokens in the vocabulary."""
    name = type(rule).__name__
    for field in ("num_accepted", "next_tokens"):
        t = getattr(verdict, field)
        if not isinstance(t, torch.Tensor) or t.dtype != torch.long or tuple(t.shape) != (rows,):
            raise ValueError(f"{name}.verify returned {field} of {getattr(t, 'dtype', type(t))} "
                             f"{tuple(getattr(t, 'shape', ()))}; it must be a torch.long tensor [{rows}] (one per row)")
    if not on_host:
        return
    n = verdict.num_accepted
    if not ids_in_range(n, nodes + 1):
        raise ValueError(f"{name}.verify accepted {n.tolist()} drafts per row of {nodes}; num_accepted must be "
                         f"between 0 and {nodes} (the drafted tokens kept, in order)")
    if not ids_in_range(verdict.next_tokens, vocab):
        raise ValueError(f"{name}.verify returned next_tokens {verdict.next_tokens.tolist()} outside the vocabulary "
                         f"0..{vocab - 1}")


def check_target_output(out, rows: int, width: int | None, vocab: int, target, method: str) -> None:
    """A target whose `prefill` / `verify` was written outside mmspec: a TargetOutput whose
    logits are [rows, width, vocab] (prefill: any width >= 1; the last column is read)."""
    name = type(target).__name__
    if not isinstance(out, TargetOutput):
        raise TypeError(f"{name}.{method} must return a mmspec.types.TargetOutput, got {type(out).__name__}")
    lg = out.logits
    want = f"[{rows}, {'L' if width is None else width}, {vocab}]"
    if (not isinstance(lg, torch.Tensor) or lg.dim() != 3 or lg.shape[0] != rows or lg.shape[2] != vocab
            or lg.shape[1] < 1 or (width is not None and lg.shape[1] != width)):
        raise ValueError(f"{name}.{method} returned logits {tuple(getattr(lg, 'shape', ()))}; they must be {want} "
                         f"(rows, {'prompt positions' if width is None else 'the root and each draft node'}, "
                         "the target's vocabulary)")
