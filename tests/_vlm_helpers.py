"""Helpers shared by the VLM tests: left-padded batches and row-by-row references."""

from __future__ import annotations

import torch


def left_pad(rows: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, L - len(r):] = r
        mask[b, L - len(r):] = 1
    return ids, mask


def assert_rows_equal(seq: torch.Tensor, L: int, refs: list[torch.Tensor], pad: int = 0) -> None:
    """Row b of `seq` (prompt width L) continues with exactly refs[b] (a single-row `generate`
    answer, which stops at EOS), then only padding."""
    for b, ref in enumerate(refs):
        got = seq[b, L:]
        assert torch.equal(got[: len(ref)], ref), (b, got, ref)
        assert bool((got[len(ref):] == pad).all()), (b, got, ref)
