"""A VLM / MAR pipeline call that raises half way closes its progress bar (it stayed among tqdm's
live bars while the traceback was kept, as a notebook keeps it, and the next call's bar was drawn
a line lower each time)."""

from __future__ import annotations

import pytest
from tqdm import tqdm

from mmspec.assets_dir import ASSETS


class Boom(Exception):
    pass


def _live():
    return [b for b in list(tqdm._instances) if not b.disable]


def test_a_failed_vlm_call_closes_its_bar(monkeypatch):
    from mmspec.pipelines import SpeculativeVLMPipeline
    from mmspec.testbed.world import World

    pipe = SpeculativeVLMPipeline.from_pretrained(ASSETS / "testbed" / "vlm")
    images = [s.image for s in World(seed=0, split="validation").sample(4)]
    calls = [0]
    generate = pipe._generate

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:  # the second of two batches
            raise Boom
        return generate(*args, **kwargs)

    monkeypatch.setattr(pipe, "_generate", failing)
    before = _live()
    with pytest.raises(Boom) as kept:  # (kept: the traceback, as a notebook keeps it)
        pipe(images, None, max_new_tokens=4, batch_size=2)
    assert calls[0] == 2 and _live() == before
    assert kept.value is not None


def test_a_failed_mar_call_closes_its_bar(monkeypatch):
    import mmspec.pipelines.mar_pipeline as mar_pipeline
    from mmspec.pipelines.mar_cli import load_mar

    pipe = load_mar(ASSETS / "testbed" / "mar")
    pipe.set_progress_bar_config(disable=False)

    def failing(*args, callback=None, **kwargs):
        callback(1)  # one step done, then out of memory
        raise Boom

    monkeypatch.setattr(mar_pipeline, "sample_mar", failing)
    before = _live()
    with pytest.raises(Boom) as kept:
        pipe([1], num_iter=8, output_type="latent", speculative=False)
    assert _live() == before
    assert kept.value is not None
