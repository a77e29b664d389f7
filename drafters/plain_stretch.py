"""Plain (K = 0) steps of an adaptive drafter, kept aside and appended at once.

A drafter with `num_draft_tokens="auto"` runs nothing on a plain step: the step's new token (and,
for EAGLE-style heads, the target's feature at it) joins the tokens the drafter catches up on the
next time it drafts. Appending to the per-row pending tensors on every plain step copied them each
time (a `cat` of a list that grows over the stretch); instead the steps' entries wait in a Python
list and `append_at_counts` writes the stretch once, each row's entries after its own pending
ones (rows' pending counts differ: each accepted its own path).
"""

from __future__ import annotations

import torch


def append_at_counts(pending: torch.Tensor, new: torch.Tensor, count: torch.Tensor, width: int) -> torch.Tensor:
    """A new tensor: `pending` [B, P, ...] widened to at least `width` columns, with row b's
    `new[b]` ([m, ...]) written at columns count[b] .. count[b] + m - 1. `pending` is not written
    (it may be a view of a step's output)."""
    B, m = new.shape[:2]
    grow = max(width - pending.shape[1], 0)
    out = torch.cat([pending, new.new_zeros(B, grow, *new.shape[2:])], 1)  # (a copy even when grow == 0)
    at = count.unsqueeze(1) + torch.arange(m, device=new.device)  # [B, m]
    out[torch.arange(B, device=new.device).unsqueeze(1), at] = new  # an index put: ~4x faster than scatter_ on CPU
    return out
