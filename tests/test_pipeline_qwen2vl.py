"""`SpeculativeVLMPipeline` with a Qwen2-VL target and a Qwen2-VL processor built locally (a
word-level tokenizer with Qwen's vision tokens, the PIL image processor at a tiny patch size):
plain answers equal the model's own `generate` on each item alone (images of three sizes and a
text-only item in one batch: per-row image-token counts and M-RoPE deltas), and speculative
answers with EAGLE and ViSpec heads and a text LM equal plain ones, whole batch and in chunks
of 2 (the text LM gets drafts accepted on some rows: ragged acceptance).

transformers' `Qwen2VLProcessor` insists on a video processor, and its video processors need
torchvision, which cannot be installed next to this CPU torch; the processor here is the real
class with its video processor left out (images only, which is all the pipeline passes)."""

from __future__ import annotations

import pytest
import torch

from mmspec.pipelines import SpeculativeVLMPipeline

from _vlm_helpers import pipeline_drafter, random_images
from conftest import tiny_qwen2vl_config

WORDS = ["<pad>", "<s>", "</s>", "<unk>", "user", "assistant", ":", "describe", "the", "image", ".", "a", "red",
         "blue", "green", "circle", "square", "what", "colour", "is", "?"]
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {% for c in m['content'] %}{% if c['type'] == 'image' %}"
            "<|vision_start|> <|image_pad|> <|vision_end|> {% else %}{{ c['text'] }} {% endif %}{% endfor %}"
            "{% endfor %}{% if add_generation_prompt %}assistant :{% endif %}")


def qwen2vl_processor():
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(WORDS)}
    vocab.update({f"w{i}": i for i in range(len(WORDS), 58)})
    vocab.update({"<|vision_start|>": 58, "<|vision_end|>": 59, "<|image_pad|>": 60, "<|video_pad|>": 61,
                  "w62": 62, "w63": 63})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = tf.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                              "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"})
    fast.padding_side = "left"
    images = getattr(tf, "Qwen2VLImageProcessorPil", None) or tf.Qwen2VLImageProcessor
    image_processor = images(patch_size=2, merge_size=2, temporal_patch_size=1, min_pixels=8 * 8, max_pixels=16 * 16)

    class ImagesOnlyQwen2VLProcessor(tf.Qwen2VLProcessor):
        def __init__(self, image_processor, tokenizer, chat_template=None):  # no ProcessorMixin checks: no video
            self.image_processor, self.tokenizer, self.video_processor = image_processor, tokenizer, None
            self.chat_template = chat_template
            self.image_token, self.video_token = tokenizer.image_token, tokenizer.video_token
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)

    return ImagesOnlyQwen2VLProcessor(image_processor, fast, chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def pipe():
    from transformers import Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(tiny_qwen2vl_config(64, 60)).double().eval()
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    return SpeculativeVLMPipeline(model, qwen2vl_processor(), None)


IMAGES = [(12, 16), (16, 16), (8, 12), None]
PROMPTS = [None, "what colour is the circle ?", "describe the image .", "describe a red square ."]


def items():
    return [None if s is None else random_images(1, seed=2 + i, size=s)[0] for i, s in enumerate(IMAGES)]


def test_plain_answers_equal_generate_item_by_item(pipe):
    images = items()
    out = pipe(images, PROMPTS, max_new_tokens=10, speculative=False)
    assert out.errors == [None] * 4
    proc, model = pipe.processor, pipe.target
    for image, prompt, seq in zip(images, PROMPTS, out.sequences):
        text = pipe._prompt(prompt, 0 if image is None else 1)
        enc = proc(images=None if image is None else [image], text=[text], return_tensors="pt")
        if "pixel_values" in enc:
            enc["pixel_values"] = enc["pixel_values"].double()
            assert int(enc["image_grid_thw"].prod()) // 4 == int((enc["input_ids"] == 60).sum())  # tokens per image
        ref = model.generate(**enc, do_sample=False, max_new_tokens=10)[0, enc["input_ids"].shape[1]:]
        assert torch.equal(seq.cpu()[: len(ref)], ref), (prompt, seq, ref)


def _drafter(model, kind):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    lm = None
    if kind == "text":  # the target's own language model with 1-D RoPE: close to the target on text
        t = model.config.text_config
        lm = Qwen2ForCausalLM(Qwen2Config(vocab_size=t.vocab_size, hidden_size=t.hidden_size,
                                          intermediate_size=t.intermediate_size, num_hidden_layers=t.num_hidden_layers,
                                          num_attention_heads=t.num_attention_heads,
                                          num_key_value_heads=t.num_key_value_heads, pad_token_id=0))
    return pipeline_drafter(model, kind, lm)


@pytest.mark.parametrize("kind", ["eagle", "vispec", "text"])
def test_speculative_answers_equal_plain_ones(pipe, kind):
    # Random heads draft and get little accepted; the text LM gets drafts accepted on some rows.
    pipe.add_drafter(kind, _drafter(pipe.target, kind))
    images = items()
    plain = pipe(images, PROMPTS, max_new_tokens=12, speculative=False)
    for batch_size in (None, 2):
        out = pipe(images, PROMPTS, max_new_tokens=12, batch_size=batch_size)
        assert out.errors == [None] * 4
        assert all(torch.equal(a, b) for a, b in zip(out.sequences, plain.sequences)), (kind, batch_size)
        assert out.stats.target_calls > 0 and out.stats.drafted_nodes > 0
        if kind == "text":
            assert out.stats.accepted_drafts > 0
