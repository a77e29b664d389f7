"""Helpers shared by the VLM tests: left-padded batches and row-by-row references."""

from __future__ import annotations

import torch


def left_pad(rows: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, L - len(r):] = r
        mask[b, L - len(r):] = 1
    return ids, mask


def assert_rows_equal(seq: torch.Tensor, L: int, refs: list[torch.Tensor], pad: int = 0) -> None:
    """Row b of `seq` (prompt width L) continues with exactly refs[b] (a single-row `generate`
    answer, which stops at EOS), then only padding."""
    for b, ref in enumerate(refs):
        got = seq[b, L:]
        assert torch.equal(got[: len(ref)], ref), (b, got, ref)
        assert bool((got[len(ref):] == pad).all()), (b, got, ref)


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {% for c in m['content'] %}{% if c['type'] == 'image' %}"
                 "<image> {% else %}{{ c['text'] }} {% endif %}{% endfor %}{% endfor %}"
                 "{% if add_generation_prompt %}assistant :{% endif %}")
WORDS = ["<pad>", "<s>", "</s>", "<unk>", "<image>", "user", "assistant", ":", "describe", "the", "image", ".", "a",
         "red", "blue", "green", "circle", "square", "triangle", "what", "colour", "is", "shape", "?", "left", "right"]


def tiny_llava_parts(dtype=torch.float64, seed: int = 0):
    """A tiny LLaVA and a real LlavaProcessor (CLIP image processor + word-level tokenizer with a
    chat template), all built locally: 16x16 images, 4 image tokens (id 4)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor, PreTrainedTokenizerFast)

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", extra_special_tokens={"image_token": "<image>"})
    image_proc = CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    processor = LlavaProcessor(image_processor=image_proc, tokenizer=fast, patch_size=8, image_token="<image>",
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=CHAT_TEMPLATE)
    text = LlamaConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                              image_size=16, patch_size=8, projection_dim=32)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=4, vision_feature_layer=-1,
                      vision_feature_select_strategy="default")
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg).to(dtype).eval()
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    return model, processor


def random_images(n: int, seed: int = 0, size=(20, 24)):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray((rng.random((*size, 3)) * 255).astype("uint8")) for _ in range(n)]


def pipeline_drafter(model, kind: str, lm=None):
    """A `DrafterComponent` for a VLM pipeline test: a random EAGLE or ViSpec head for `model`, or
    (kind "text") `lm`, a causal LM of the target's text shape, given the target's own language
    model and LM head (close to the target on text), drafting 3 tokens."""
    from mmspec.drafters import EagleHead, EagleHeadConfig, ViSpecHead
    from mmspec.pipelines import DrafterComponent

    torch.manual_seed(1)
    if kind == "text":
        lm = lm.to(torch.float64).eval()
        lm.model.load_state_dict(model.model.language_model.state_dict())
        lm.lm_head.load_state_dict(model.lm_head.state_dict())
        return DrafterComponent.from_lm(lm, 3)
    config = EagleHeadConfig.for_target(model, kind=kind) if kind == "vispec" else EagleHeadConfig.for_target(model)
    return DrafterComponent.from_head((ViSpecHead if kind == "vispec" else EagleHead)(config).double())
