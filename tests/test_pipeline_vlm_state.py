"""The VLM pipeline leaves the caller's objects as they were: a target or drafter the caller is
training keeps its train / eval modes (the call runs them in eval mode), the caller's processor keeps
its padding side; generation_config settings the loop cannot apply are named in a warning; rows of
a batch that end at different lengths each get their own answer."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import LlamaForCausalLM

from mmspec.pipelines import DrafterComponent, SpeculativeVLMPipeline

from _vlm_helpers import random_images, tiny_llava_parts


def _text_drafter(model):
    torch.manual_seed(1)
    lm = LlamaForCausalLM(model.config.text_config).double()
    lm.model.load_state_dict(model.model.language_model.state_dict())
    return DrafterComponent.from_lm(lm, 3)


def test_a_call_runs_in_eval_mode_and_puts_back_the_callers_modes_and_padding_side():
    model, processor = tiny_llava_parts(seed=3)
    images, prompts = random_images(3, seed=5), ["what colour is the circle ?", None, "describe the image"]
    ref = SpeculativeVLMPipeline(model, processor)(images, prompts, max_new_tokens=8, speculative=False)
    # the caller is fine-tuning: model in training mode with active dropout, one part kept in eval on purpose
    model.train()
    model.model.vision_tower.eval()
    model.model.language_model.layers[0].self_attn.attention_dropout = 0.5
    drafter = _text_drafter(model).train()
    processor.tokenizer.padding_side = "right"
    modes = [m.training for m in model.modules()] + [m.training for m in drafter.modules()]
    pipe = SpeculativeVLMPipeline(model, processor, drafter)
    out = pipe(images, prompts, max_new_tokens=8)
    assert out.texts == ref.texts  # decoded in eval mode (dropout off), left-padded
    assert [m.training for m in model.modules()] + [m.training for m in drafter.modules()] == modes
    assert processor.tokenizer.padding_side == "right"
    # also when a batch raises inside the call
    with pytest.raises(ValueError, match="image"):
        pipe(images[:1], ["<image> <image> two placeholders, one image"], max_new_tokens=4)
    assert [m.training for m in model.modules()] + [m.training for m in drafter.modules()] == modes


def test_generation_config_settings_the_loop_cannot_apply_are_named_in_a_warning():
    model, processor = tiny_llava_parts(seed=4)
    pipe = SpeculativeVLMPipeline(model, processor, _text_drafter(model).eval())
    image = random_images(1, seed=6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the defaults warn of nothing
        pipe(image, max_new_tokens=4)
    model.generation_config.repetition_penalty = 1.05
    model.generation_config.min_new_tokens = 8
    with pytest.warns(UserWarning, match=r"sets repetition_penalty=1.05, min_new_tokens=8, which this pipeline does "
                                         r"not apply"):
        pipe(image, max_new_tokens=4)


def test_batched_answers_of_different_lengths_equal_each_item_alone():
    """Rows that stop at EOS after different lengths: each answer is cut out of the batch at its
    own length (the tiny random models never emit EOS, so every other test's rows end together)."""
    from mmspec.assets_dir import ASSETS

    pipe = SpeculativeVLMPipeline.from_pretrained(ASSETS / "testbed" / "vlm")
    pipe.set_progress_bar_config(disable=True)
    images = random_images(3, seed=3, size=(64, 64))
    prompts = [None, "what colour is the circle ?", "how many shapes are there ?"]
    batch = pipe(images, prompts, max_new_tokens=40)
    assert len(set(batch.stats.new_tokens)) == 3  # the case this test is about
    for i in range(3):
        alone = pipe(images[i], prompts[i], max_new_tokens=40)
        assert batch.texts[i] == alone.texts[0] and torch.equal(batch.sequences[i], alone.sequences[0])
    # plain decoding samples the target exactly whatever rule is named, and says so
    plain = pipe(images[:2], max_new_tokens=6, temperature=1.0, speculative=False, acceptance="typical",
                 generator=torch.Generator().manual_seed(0))
    assert plain.stats.lossless is True
