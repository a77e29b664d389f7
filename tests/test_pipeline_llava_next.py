"""`SpeculativeVLMPipeline` with a LLaVA-NeXT target and its real processor built locally
(word-level tokenizer, the PIL `LlavaNextImageProcessor` with anyres pinpoints): images of
three sizes give 14, 16 and 24 image tokens (tiles, unpadding, newline tokens), mixed with a
text-only item in one batch. Plain answers equal the model's own `generate` on each item alone;
EAGLE, ViSpec and text-LM drafters give the plain answers, whole batch and in chunks of 2, with
drafts accepted on some rows and not others (ragged rows)."""

from __future__ import annotations

import pytest
import torch

import mmspec
from mmspec.drafters.null_drafter import NullDrafter
from mmspec.pipelines import SpeculativeVLMPipeline

from _vlm_helpers import CHAT_TEMPLATE, WORDS, pipeline_drafter, random_images

PINPOINTS = [[16, 32], [32, 16], [32, 32]]
IMG = WORDS.index("<image>")


@pytest.fixture(scope="module")
def pipe():
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                      unk_token="<unk>", extra_special_tokens={"image_token": "<image>"})
    images = getattr(tf, "LlavaNextImageProcessorPil", None) or tf.LlavaNextImageProcessor
    image_processor = images(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16},
                             image_grid_pinpoints=PINPOINTS)
    processor = tf.LlavaNextProcessor(image_processor=image_processor, tokenizer=fast, patch_size=8,
                                      vision_feature_select_strategy="default", image_token="<image>",
                                      num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE)
    text = tf.LlamaConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                 image_size=16, patch_size=8, projection_dim=32)
    config = tf.LlavaNextConfig(vision_config=vision, text_config=text, image_token_index=IMG, vision_feature_layer=-1,
                                vision_feature_select_strategy="default", image_grid_pinpoints=PINPOINTS)
    torch.manual_seed(2)
    model = tf.LlavaNextForConditionalGeneration(config).double().eval()
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    return SpeculativeVLMPipeline(model, processor, None)


SIZES = [(16, 32), (30, 20), (32, 32), None]
PROMPTS = [None, "what colour is the circle ?", "describe the image .", "describe the red square ."]


def items():
    return [None if s is None else random_images(1, seed=i, size=s)[0] for i, s in enumerate(SIZES)]


def test_plain_answers_equal_generate_item_by_item(pipe):
    images = items()
    out = pipe(images, PROMPTS, max_new_tokens=10, speculative=False)
    assert out.errors == [None] * 4
    counts = []
    for image, prompt, seq in zip(images, PROMPTS, out.sequences):
        enc = pipe.processor(images=None if image is None else [image], text=[pipe._prompt(prompt, int(image is not None))],
                             return_tensors="pt")
        if "pixel_values" in enc:
            enc["pixel_values"] = enc["pixel_values"].double()
        counts.append(int((enc["input_ids"] == IMG).sum()))
        ref = pipe.target.generate(**enc, do_sample=False, max_new_tokens=10)[0, enc["input_ids"].shape[1]:]
        assert torch.equal(seq.cpu()[: len(ref)], ref), (prompt, seq, ref)
    assert len(set(counts[:3])) == 3 and counts[3] == 0  # three image-token counts in one batch


def _drafter(model, kind):
    from transformers import LlamaForCausalLM

    lm = LlamaForCausalLM(model.config.text_config) if kind == "text" else None
    return pipeline_drafter(model, kind, lm)


@pytest.mark.parametrize("kind", ["eagle", "vispec", "text"])
def test_speculative_answers_equal_plain_ones(pipe, kind):
    images = items()
    plain = pipe(images, PROMPTS, max_new_tokens=16, speculative=False)
    pipe.add_drafter(kind, _drafter(pipe.target, kind))
    for batch_size in (None, 2):
        out = pipe(images, PROMPTS, max_new_tokens=16, batch_size=batch_size)
        assert out.errors == [None] * 4
        assert all(torch.equal(a, b) for a, b in zip(out.sequences, plain.sequences)), (kind, batch_size)
        assert out.stats.drafted_nodes > 0
        if kind == "text":  # the text-only row drafts exactly what the target says
            assert out.stats.accepted_drafts > 0


def test_save_and_load_round_trip(pipe, tmp_path):
    """The saved folder (target, processor with the anyres image processor, drafters) loads back
    and answers identically."""
    pipe.add_drafter("text", _drafter(pipe.target, "text"))
    images = items()
    before = pipe(images, PROMPTS, max_new_tokens=12)
    pipe.save_pretrained(tmp_path / "saved")
    loaded = SpeculativeVLMPipeline.from_pretrained(tmp_path / "saved")
    assert type(loaded.processor.image_processor).__name__ == type(pipe.processor.image_processor).__name__
    assert loaded.processor.image_processor.image_grid_pinpoints == PINPOINTS
    after = loaded(images, PROMPTS, max_new_tokens=12)
    assert after.errors == [None] * 4
    assert all(torch.equal(a, b) for a, b in zip(before.sequences, after.sequences))


def test_pixels_without_image_sizes_are_refused_by_name(pipe):
    """LLaVA-NeXT's image features need each image's original size: without image_sizes the
    forward failed deep in transformers ("'NoneType' object is not iterable")."""
    enc = pipe.processor(images=[items()[0]], text=[pipe._prompt(PROMPTS[0], 1)], return_tensors="pt")
    enc["pixel_values"] = enc["pixel_values"].double()
    enc.pop("image_sizes")
    with pytest.raises(ValueError, match="LlavaNextForConditionalGeneration needs image_sizes with pixel_values"):
        mmspec.speculative_generate(pipe.target, NullDrafter(pipe.target.config.text_config.vocab_size), **enc,
                                    temperature=0, max_new_tokens=2)
