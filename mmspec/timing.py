"""Step timers that attribute time to the right phase on any device.

On CPU a phase's time is the host clock between its marks. On CUDA the host runs ahead of
the GPU, so host clocks would charge drafter kernels to whichever phase first synchronises
(usually verify). `PhaseTimer` records CUDA events instead (no host sync per step) and
resolves them once, at the end of the run.
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
