"""Where the adaptive controller's per-step costs come from on CUDA, checked on the CPU with
stand-in events: the host clock returns from `propose` before the drafter's kernels ran (they
finish inside the verify step's sync), so the drafter's share must come from the step's device
events, which that sync has completed; a span still pending falls back to the host clocks."""

from __future__ import annotations


import mmspec
import mmspec.engine as engine
from mmspec.adaptive import DraftLengthController
from mmspec.drafters import ModelDrafter
from mmspec.timing import PhaseTimer

from conftest import left_padded

DEVICE_DRAFT_S = 7.0  # each propose() on the stand-in device timeline


class Event:
    def __init__(self, t: float, done: bool):
        self.t, self.done = t, done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: "Event") -> float:  # milliseconds, as torch.cuda.Event's
        return (end.t - self.t) * 1000.0


DEVICE = {"clock": 0.0}  # the stand-in device timeline: host marks read it, propose() advances it


def stand_in_timer(done: bool):
    class StandInCudaTimer(PhaseTimer):
        """Marks are events on the stand-in device timeline; the end-of-run totals read them
        without a sync."""

        def __init__(self, device):
            super().__init__(device)
            self.cuda = True

        def mark(self):
            DEVICE["clock"] += 0.001
            return Event(DEVICE["clock"], done)

        def totals(self):
            for phase, start, end in self._spans:
                self._totals[phase] += start.elapsed_time(end) / 1000.0
            self._spans.clear()
            return dict(self._totals)

    return StandInCudaTimer


class Recording(DraftLengthController):
    def __init__(self):
        super().__init__(3, warmup=(3,), probe_every=0)
        self.seen = []

    def observe(self, batch, k, accepted, draft_seconds, verify_seconds, **kw):
        self.seen.append((k, draft_seconds, verify_seconds))
        return super().observe(batch, k, accepted, draft_seconds, verify_seconds, **kw)


def run(target, drafter_model, monkeypatch, done):
    monkeypatch.setattr(engine, "PhaseTimer", stand_in_timer(done))
    drafter = ModelDrafter(drafter_model, "auto", max_draft_tokens=3)
    drafter.controller = Recording()
    propose = drafter.propose

    def launched(*args, **kwargs):  # returns at once on the host; its kernels take DEVICE_DRAFT_S
        DEVICE["clock"] += DEVICE_DRAFT_S
        return propose(*args, **kwargs)

    drafter.propose = launched
    ids, mask = left_padded([5, 3])
    mmspec.speculative_generate(target, drafter, ids, mask, temperature=0, max_new_tokens=8, pad_token_id=0)
    return drafter.controller.seen


def test_cuda_draft_cost_comes_from_the_completed_device_events(target, good_drafter, monkeypatch):
    seen = run(target, good_drafter, monkeypatch, done=True)
    assert seen and all(k == 3 for k, _, _ in seen)
    # Every propose() span lasted DEVICE_DRAFT_S on the device while its host call took
    # milliseconds: the drafter is charged the device time and verify the host step less it.
    for _, draft_s, verify_s in seen:
        assert DEVICE_DRAFT_S - 0.01 < draft_s < DEVICE_DRAFT_S + 1.0
        assert verify_s == 0.0  # host step (ms) less the device draft time, floored at 0


def test_pending_events_fall_back_to_the_host_clocks(target, good_drafter, monkeypatch):
    seen = run(target, good_drafter, monkeypatch, done=False)
    assert seen and all(draft_s < 1.0 and verify_s < 1.0 for _, draft_s, verify_s in seen)
