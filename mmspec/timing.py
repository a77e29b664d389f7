"""Step timers that attribute time to the right phase on any device.

On CPU a phase's time is the host clock between its marks. On CUDA the host runs ahead of
the GPU, so host clocks would charge drafter kernels to whichever phase first synchronises
(usually verify). `PhaseTimer` records CUDA events instead (no host sync per step) and
resolves them once, at the end of the run; `completed_span` reads a span the step's own sync
has completed (the adaptive controller's per-step draft cost).
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch


class PhaseTimer:
    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
        self._spans: list[tuple[str, object, object]] = []
        self._totals: dict[str, float] = defaultdict(float)

    def mark(self):
        """A point in time on the device's timeline."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def completed_span(self, start, end) -> float | None:
        """Seconds between two CUDA marks whose work has completed (after a step's sync), without
        synchronising; None on CPU or while `end` is still pending on the device."""
        if not self.cuda or not end.query():
            return None
        return start.elapsed_time(end) / 1000.0

    def charge(self, phase: str, start, end) -> None:
        if self.cuda:
            self._spans.append((phase, start, end))
        else:
            self._totals[phase] += end - start

    def totals(self) -> dict[str, float]:
        """Seconds per phase (synchronises once on CUDA)."""
        if self._spans:
            torch.cuda.synchronize()  # SYNC: once per run, to read the events
            for phase, start, end in self._spans:
                self._totals[phase] += start.elapsed_time(end) / 1000.0
            self._spans.clear()
        return dict(self._totals)
