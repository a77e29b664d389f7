"""Timing a target's verify forward at several query widths Q (the `verify_cost` of `mmspec bench
imagegen` / `vlm`): median seconds per width and the ratio to the one-token forward.

Each round runs every width in turn (the order reversed every other round, so load drift hits
all widths alike), and each width first runs `warm` untimed calls, then one timed call. Why the
warm calls: a model may run different kernels at different widths (`prepack="auto"`: stock
weights for one token, prepacked copies for a verify), and a one-token forward right after a
17-token one reads its weights from colder caches than any decoding step does (measured on the
testbed image GPT: 1.33 ms cold against 0.89 ms warm, which made a 17-token verify look 1.4x
a one-token step instead of 2.3x). In decoding, consecutive forwards have the same width
(plain steps) or nearly (verifies), so warm timings are the ones that predict a run."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def time_widths(call: Callable[[int], object], widths, rounds: int = 20, warm: int = 2, device=None) -> dict:
    """`call(Q)` runs one forward of width Q. Returns {"seconds": {Q: median}, "ratio_to_one_token":
    {Q: median / median at Q = 1}} (string keys, as saved in the bench JSON). On a CUDA `device`
    every call is followed by a device sync, so the host clock times the device's work."""
    if device is not None and torch.device(device).type == "cuda":
        inner = call

        def call(Q):
            out = inner(Q)
            torch.cuda.synchronize(device)
            return out
    widths = list(widths)
    if 1 not in widths:
        raise ValueError(f"widths must include 1 (the one-token forward every ratio is taken against), got {widths}")
    if rounds < 1 or warm < 0:
        raise ValueError(f"rounds must be >= 1 and warm >= 0, got {rounds}, {warm}")
    times: dict[int, list[float]] = {Q: [] for Q in widths}
    for r in range(rounds):
        for Q in (widths if r % 2 == 0 else widths[::-1]):
            for _ in range(warm):
                call(Q)
            t0 = time.perf_counter()
            call(Q)
            times[Q].append(time.perf_counter() - t0)
    med = {Q: statistics.median(t) for Q, t in times.items()}
    return {"seconds": {str(q): round(t, 6) for q, t in med.items()},
            "ratio_to_one_token": {str(q): round(t / med[1], 3) for q, t in med.items()}}
