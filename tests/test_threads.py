"""Threads sharing a model or a pipeline (session 59's review): the feature hooks on a shared
bare model read only their own thread's forwards, and an image pipeline's `_interrupt` stops
only the call it was set in (per thread, kept across a nested call)."""

from __future__ import annotations

import threading

import torch

from mmspec.models.hf_target import HFTarget
from mmspec.types import FeatureRequest

from conftest import tiny_llama


@torch.no_grad()
def test_feature_hooks_ignore_forwards_of_other_threads():
    model = tiny_llama()
    spec = HFTarget(model).spec
    captured = {}
    handles = spec._hooks(FeatureRequest(last_hidden=True), captured, model)
    try:
        other = threading.Thread(target=lambda: model(input_ids=torch.tensor([[3, 4, 5, 6, 7]])))
        other.start()
        other.join()
        assert "last" not in captured  # another request's batch landed here (and crashed the head)
        model(input_ids=torch.tensor([[3, 4]]))
        assert captured["last"].shape[:2] == (1, 2)
    finally:
        for h in handles:
            h.remove()


def test_an_image_interrupt_stops_only_its_own_call():
    from test_ar_image_pipeline import make_pipe

    pipe = make_pipe()
    seen = {}

    def other_thread():
        seen["other"] = pipe([1], temperature=0, output_type="latent", callback_on_step_end=lambda p, s, d, kw: kw)

    def stop_and_start_another(p, step, done, kw):
        if step == 1:
            p._interrupt = True
            t = threading.Thread(target=other_thread)
            t.start()
            t.join()
            seen["inner"] = p([0], temperature=0, output_type="latent")  # a nested call: the stop survives it
        return kw

    out = pipe([0, 1], temperature=0, output_type="latent", callback_on_step_end=stop_and_start_another)
    assert out.interrupted and out.stats.target_calls == 1
    assert not seen["other"].interrupted and not seen["inner"].interrupted  # the other thread ran to the end
    assert pipe._interrupt is False  # restored after the call
