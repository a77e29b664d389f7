"""Refusals found by session 59's error-message review: each names what it refuses and says what
to do, where Python or torch spoke before (an AttributeError, an unpacking error, a torch dtype
error), or where a saved head of the wrong kind could not be loaded back."""

from __future__ import annotations

import pytest
import torch

import mmspec
from mmspec.drafters import EagleHead, EagleHeadConfig, ViSpecHead
from mmspec.drafters.flash import FlashHead
from mmspec.models.llamagen_spec import llamagen_target, null_class_uncond

from _llamagen_helpers import NUM_CLASSES, tiny_gpt
from conftest import tiny_llama, tiny_llava_config


def test_a_head_class_refuses_a_config_of_another_kind_and_a_folder_of_another_kind(tmp_path):
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration(tiny_llava_config())
    with pytest.raises(ValueError, match=r"FlashHead needs EagleHeadConfig\(kind='flash'\), got kind='eagle'"):
        FlashHead(EagleHeadConfig.for_target(model, slots=3))  # it saved as "eagle" and failed to load back
    with pytest.raises(ValueError, match=r"ViSpecHead needs EagleHeadConfig\(kind='vispec'\)"):
        ViSpecHead(EagleHeadConfig.for_target(model))
    EagleHead(EagleHeadConfig.for_target(model)).save_pretrained(tmp_path / "eagle")
    with pytest.raises(ValueError, match="holds a 'eagle' head, not a FlashHead"):
        FlashHead.from_pretrained(tmp_path / "eagle")  # it returned an EagleHead
    flash = FlashHead(EagleHeadConfig.for_target(model, kind="flash", slots=3))
    flash.save_pretrained(tmp_path / "flash")
    assert isinstance(EagleHead.from_pretrained(tmp_path / "flash"), FlashHead)
    (tmp_path / "flash" / "drafter_config.json").write_text(
        (tmp_path / "flash" / "drafter_config.json").read_text().replace('"slots": 3', '"slots": 4'))
    with pytest.raises(ValueError, match="does not fit its drafter_config.json"):
        EagleHead.from_pretrained(tmp_path / "flash")


def test_wrong_objects_for_targets_and_drafters_get_a_remedy():
    model = tiny_llama()
    ids = torch.tensor([[3, 4, 5]])
    with pytest.raises(TypeError, match=r"ModelDrafter\(model\)"):
        mmspec.speculative_generate(model, tiny_llama(seed=1), ids, max_new_tokens=2)
    with pytest.raises(ValueError, match="num_draft_tokens: an option of the drafter"):
        mmspec.speculative_generate(model, mmspec.drafters.ModelDrafter(tiny_llama(seed=1)), ids, max_new_tokens=2,
                                    num_draft_tokens=3)
    with pytest.raises(TypeError, match="did you swap target and drafter"):
        mmspec.speculative_generate(mmspec.drafters.ModelDrafter(tiny_llama(seed=1)), model, ids, max_new_tokens=2)
    with pytest.raises(TypeError, match=r"use mmspec.models.hf_target.HFTarget\(model"):
        mmspec.SpecTarget(model, static=True)
    from mmspec.models.hf_target import HFTarget

    for bad in (None, "gpt2", torch.nn.Linear(2, 2)):
        with pytest.raises(TypeError, match="the target must be a transformers model"):
            HFTarget(bad)


def test_guided_target_callbacks_are_named():
    target = llamagen_target(tiny_gpt(0), 1.0, num_tokens=16)
    with pytest.raises(TypeError, match="make_uncond must be a callable"):
        mmspec.GuidedTarget(target, 3.0, make_uncond=5)
    with pytest.raises(TypeError, match="uncond_input_ids must be a 2-D integer tensor"):
        mmspec.GuidedTarget(target, 3.0, uncond_input_ids=[[1, 2]])
    make = null_class_uncond(NUM_CLASSES)
    for broken in (lambda i, m, x: None, lambda i, m, x: make(i, m, x)[:2],
                   lambda i, m, x: (i.tolist(), m, x), lambda i, m, x: (*make(i, m, x)[:2], None)):
        guided = mmspec.GuidedTarget(target, 3.0, make_uncond=broken)
        with pytest.raises(TypeError, match="make_uncond must return"):
            mmspec.speculative_generate(guided, mmspec.drafters.NullDrafter(guided.vocab_size),
                                        torch.tensor([[0], [1]]), max_new_tokens=2)


def test_pipeline_inputs_of_the_wrong_type_are_named():
    from mmspec.pipelines import SpeculativeMARPipeline, SpeculativeVLMPipeline

    from _vlm_helpers import random_images, tiny_llava_parts
    from test_mar_cspd import tiny_mar, tiny_vae

    pipe = SpeculativeMARPipeline(transformer=tiny_mar(), vae=tiny_vae())
    for bad in (None, "cat", [1, "a"]):
        with pytest.raises(ValueError, match="class_labels must be an int or a non-empty 1-D sequence"):
            pipe(bad, num_iter=2)
    vlm = SpeculativeVLMPipeline(*tiny_llava_parts())
    with pytest.raises(TypeError, match="prompts must be None, a string or a list"):
        vlm(random_images(1), 5, speculative=False)
