"""`compress_image_spans`: the input layout of the vision-aware draft heads (ViSpec, FLASH).

Each row's pairs are walked from its first real one in runs of image pairs and text pairs. An
image run is replaced by the few inputs its head makes of it, placed at the run's *last*
positions (positions are kept, so later text keeps its RoPE distance to the image); a text run
keeps one input per pair. Rows of different compressed lengths are right-aligned (left-padded),
as the head's ragged cache expects."""

from __future__ import annotations

from typing import Callable

import torch


def compress_image_spans(embeds: torch.Tensor, mask: torch.Tensor, is_img: torch.Tensor,
                         image_inputs: Callable[[int, int, int], torch.Tensor],
                         text_inputs: Callable[[int, int, int], torch.Tensor]):
    """`image_inputs(row, t, e)` -> [m, H] inputs for image pairs t..e-1 (m <= e - t);
    `text_inputs(row, t, e)` -> [e - t, H]; both are called in order along each row. Returns
    (inputs [B, L', H], kept positions [B, L'], mask [B, L'], source pair index [B, L'])."""
    B, L, H = embeds.shape
    device = embeds.device
    real_host, img_host = mask.bool().tolist(), is_img.tolist()  # SYNC: once per request
    rows = []
    for b in range(B):
        start = real_host[b].index(True)
        xs, src = [], []
        t = start
        while t < L:
            e, kind = t, img_host[b][t]
            while e < L and img_host[b][e] == kind:
                e += 1
            x = image_inputs(b, t, e) if kind else text_inputs(b, t, e)
            xs.append(x)
            src.append(torch.arange(e - x.shape[0], e, device=device))
            t = e
        rows.append((torch.cat(xs), torch.cat(src), start))
    Lc = max(r[0].shape[0] for r in rows)
    x = embeds.new_zeros(B, Lc, H)
    positions = torch.zeros(B, Lc, dtype=torch.long, device=device)
    src = torch.zeros_like(positions)
    mask2 = torch.zeros_like(positions)
    for b, (xb, sb, start) in enumerate(rows):
        n = xb.shape[0]
        x[b, Lc - n:], positions[b, Lc - n:], src[b, Lc - n:], mask2[b, Lc - n:] = xb, sb - start, sb, 1
    return x, positions, mask2, src
