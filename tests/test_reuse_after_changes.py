"""Objects built once and reused follow what changed since: a model cast after it was wrapped,
static buffers made under torch.inference_mode, a VLM pipeline's swapped target or processor.
Each reused object answers as a freshly built one."""

from __future__ import annotations

import copy

import pytest
import torch

import mmspec
from conftest import left_padded, noisy_copy, tiny_llama
from mmspec.drafters import ModelDrafter
from mmspec.drafters.null_drafter import NullDrafter
from mmspec.models import HFTarget


def plain(model, ids, mask, n=10):
    return mmspec.speculative_generate(model, NullDrafter(model.config.vocab_size), ids, mask, temperature=0,
                                       max_new_tokens=n).sequences


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("first,then", [(torch.float64, torch.float32), (torch.float32, torch.float64)])
def test_a_wrap_follows_its_model_cast_after_wrapping(static, first, then):
    """The wrap kept the dtype it was built with (its masks then failed in SDPA against the
    cast model's queries), and static buffers of the old dtype were reused."""
    ids, mask = left_padded([5, 8, 3])
    model = tiny_llama(dtype=first)
    small = noisy_copy(model, 0.3)
    target = HFTarget(model, prepack=False, static=static)
    drafter = ModelDrafter(small, 3, prepack=False, static=static)
    assert torch.equal(mmspec.speculative_generate(target, drafter, ids, mask, temperature=0, max_new_tokens=10)
                       .sequences, plain(model, ids, mask))
    model.to(then), small.to(then)
    reused = mmspec.speculative_generate(target, drafter, ids, mask, temperature=0, max_new_tokens=10).sequences
    assert torch.equal(reused, plain(model, ids, mask))


def test_static_buffers_made_under_inference_mode_are_not_reused_outside_it():
    ids, mask = left_padded([7, 4, 6])
    model = tiny_llama(2, 0)
    target, drafter = HFTarget(model, static=True), ModelDrafter(noisy_copy(model, 0.3), 3, static=True)
    expected = plain(model, ids, mask)
    with torch.inference_mode():
        inside = mmspec.speculative_generate(target, drafter, ids, mask, temperature=0, max_new_tokens=10)
    kept = target.runner.kv.keys[0]
    outside = mmspec.speculative_generate(target, drafter, ids, mask, temperature=0, max_new_tokens=10)
    assert torch.equal(inside.sequences, expected) and torch.equal(outside.sequences, expected)
    assert kept.is_inference() and target.runner.kv.keys[0] is not kept
    again = target.runner.kv.keys[0]  # an ordinary buffer of the same shapes is kept (CUDA graphs rely on it)
    mmspec.speculative_generate(target, drafter, ids, mask, temperature=0, max_new_tokens=10)
    assert target.runner.kv.keys[0] is again


@torch.no_grad()
def test_vlm_pipeline_follows_a_swapped_target_and_processor():
    """`pipe.target = other` kept decoding with the old model (its wrap was built once), and a
    swapped processor kept its tokenizer's right padding (refused as not left-padded)."""
    from _vlm_helpers import random_images, tiny_llava_parts
    from mmspec.pipelines import SpeculativeVLMPipeline

    model_a, processor = tiny_llava_parts(seed=0)
    model_b, _ = tiny_llava_parts(seed=7)
    images, prompts = random_images(2), ["what colour is the circle ?", None]
    pipe = SpeculativeVLMPipeline(model_a, processor)
    before = pipe(images, prompts, max_new_tokens=8, speculative=False).texts
    fresh_b = SpeculativeVLMPipeline(model_b, processor)(images, prompts, max_new_tokens=8, speculative=False).texts
    assert fresh_b != before
    pipe.target = model_b
    assert pipe(images, prompts, max_new_tokens=8, speculative=False).texts == fresh_b
    pipe.target = model_a
    other = copy.deepcopy(processor)
    other.tokenizer.padding_side = "right"  # as a Llama tokenizer loads
    pipe.processor = other
    assert pipe(images, prompts, max_new_tokens=8, speculative=False).texts == before
    with pytest.raises(ValueError, match="SpeculativeVLMPipeline supports model types"):
        pipe.target = "not a model"
    assert pipe.target is model_a


def test_controllers_per_step_logs_stay_bounded_on_a_long_running_drafter():
    """A drafter serving requests for days appended every step's choice to a list forever."""
    from mmspec.adaptive import DraftLengthController
    from mmspec.adaptive_window import WindowBandit
    from mmspec.recent import Recent

    log = Recent(keep=5)
    for i in range(23):
        log.append(i)
    assert list(log) == list(range(15, 23)) and len(log) <= 10  # the newest, in order
    for controller in (DraftLengthController(4), WindowBandit(8)):
        assert isinstance(controller.history, Recent) and controller.history.keep == 100_000
    assert isinstance(WindowBandit(8).requests, Recent)


def test_one_request_at_a_time_per_target_and_drafter():
    """Two threads decoding through one drafter overwrote each other's caches (shape errors from
    deep in the forward, and wrong tokens returned silently); the second request is refused by
    name, and threads with their own drafters over one bare model decode correctly."""
    import threading

    from mmspec import GuidedTarget
    from mmspec.in_use import exclusive

    model = tiny_llama(2, 0)
    ids, mask = left_padded([6, 4])
    expected = plain(model, ids, mask)
    target, drafter = HFTarget(model), ModelDrafter(noisy_copy(model, 0.3), 3)
    with exclusive(target, drafter):  # as if another thread were decoding through them
        with pytest.raises(ValueError, match="ModelDrafter is decoding another request right now"):
            mmspec.speculative_generate(target, drafter, ids, mask, temperature=0, max_new_tokens=10)
        with pytest.raises(ValueError, match="HFTarget is decoding another request right now"):
            mmspec.speculative_generate(GuidedTarget(target, 1.0, uncond_input_ids=ids), NullDrafter(40), ids, mask,
                                        temperature=0, max_new_tokens=10)
    assert torch.equal(mmspec.speculative_generate(target, drafter, ids, mask, temperature=0, max_new_tokens=10)
                       .sequences, expected)  # released: usable again
    results = {}

    def work(i):
        out = mmspec.speculative_generate(model, ModelDrafter(noisy_copy(model, 0.3, seed=i), 3), ids, mask,
                                          temperature=0, max_new_tokens=10)
        results[i] = torch.equal(out.sequences, expected)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert results == {i: True for i in range(4)}


def test_an_image_callback_may_call_the_pipeline_back():
    """Each image-pipeline call with a drafter GPT decodes through its own target and drafter
    objects (a JacobiDrafter component is one object, refused while busy), so a callback that
    generates again (a preview, say) leaves the outer run's tokens as they were."""
    from test_ar_image_pipeline import make_pipe

    pipe = make_pipe()
    alone = pipe([0, 2], temperature=0, output_type="latent").tokens
    inner = []
    nested = pipe([0, 2], temperature=0, output_type="latent",
                  callback_on_step_end=lambda p, s, d, kw: inner.append(p([1], temperature=0, output_type="latent")))
    assert torch.equal(nested.tokens, alone) and len(inner) == nested.stats.target_calls  # one per verify forward
    assert torch.equal(inner[0].tokens, pipe([1], temperature=0, output_type="latent").tokens)


def test_a_shadow_probe_of_a_request_that_raised_does_not_reach_the_next():
    """A plain step's shadow probe (drafter catch-up measuring acceptance) due or recorded when a
    request raised was read by the next request's first step, with another request's rows."""
    from mmspec.adaptive import DraftLengthController

    ctrl = DraftLengthController(4)
    ctrl._shadow_due, ctrl._shadow_rows = True, [(1, 1), (0, 1)]
    ctrl.begin_request()
    assert ctrl._shadow_due is False and ctrl._shadow_rows is None


def test_a_static_llamagen_target_follows_its_model_cast_after_wrapping():
    """LlamaGenSpec kept the dtype it was built with, so a static target reused the previous
    request's key buffers in the old dtype after `gpt.to(dtype)` (keys cast on write, then
    attention on mixed dtypes)."""
    from mmspec.models.llamagen_spec import LlamaGenSpec
    from mmspec.spec_target import SpecTarget

    from _llamagen_helpers import LABELS, noisy_gpt, plain_greedy, tiny_gpt

    gpt = tiny_gpt(0, dtype=torch.float32)
    small = noisy_gpt(gpt, 0.3)
    target, drafter = SpecTarget(LlamaGenSpec(gpt, prepack=False), static=True), ModelDrafter(LlamaGenSpec(small), 3)
    mmspec.speculative_generate(target, drafter, LABELS.view(-1, 1), temperature=0, max_new_tokens=16)
    gpt.double(), small.double()
    out = mmspec.speculative_generate(target, drafter, LABELS.view(-1, 1), temperature=0, max_new_tokens=16)
    assert torch.equal(out.sequences[:, 1:], plain_greedy(gpt))
