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
    cfg = model.generation_config
    # neutral values (what resetting a setting gives) act nowhere and warn of nothing
    cfg.repetition_penalty, cfg.num_beams, cfg.min_new_tokens, cfg.no_repeat_ngram_size = 1.0, 1, 0, 0
    cfg.typical_p, cfg.suppress_tokens, cfg.guidance_scale = 1.0, [], 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe(image, max_new_tokens=4)
    cfg.repetition_penalty, cfg.min_new_tokens, cfg.guidance_scale = 1.05, 8, 3.0
    with pytest.warns(UserWarning, match=r"sets repetition_penalty=1.05, guidance_scale=3.0, min_new_tokens=8, "
                                         r"which this pipeline does not apply"):
        pipe(image, max_new_tokens=4)
    cfg.repetition_penalty, cfg.min_new_tokens, cfg.guidance_scale, cfg.min_p = None, None, None, 0.1
    with warnings.catch_warnings():  # a sampling warper acts only when sampling
        warnings.simplefilter("error")
        pipe(image, max_new_tokens=4)
    with pytest.warns(UserWarning, match=r"sets min_p=0.1, which"):
        pipe(image, max_new_tokens=4, temperature=1.0)
    cfg.min_p, cfg.dola_layers = None, "low"  # another decoding mode than greedy search or sampling
    with pytest.warns(UserWarning, match=r"sets generation mode 'dola_generation', which"):
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


def test_overlapping_calls_put_the_modes_back_when_the_last_one_ends():
    """Two calls at once (two threads) on one model: the second saw the first's eval modes and
    put those back; the caller's training mode is restored only when the last call ends."""
    from mmspec.models.eval_mode import eval_modes

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)).train()
    model[0].eval()  # a part kept in eval mode on purpose
    first, second = eval_modes(model), eval_modes(model)
    first.__enter__()
    second.__enter__()
    assert not any(m.training for m in model.modules())
    first.__exit__(None, None, None)
    assert not any(m.training for m in model.modules())  # the second call still runs in eval mode
    second.__exit__(None, None, None)
    assert [m.training for m in model.modules()] == [True, False, True]
    with pytest.raises(TypeError, match="eval_modes takes torch.nn.Module objects"):
        with eval_modes(model, "not a module"):
            pass
    assert [m.training for m in model.modules()] == [True, False, True]  # untouched, nothing left held
    with eval_modes(model):
        assert not any(m.training for m in model.modules())
