"""Shared fixtures: tiny random Llama models built in float64 (exactness is asserted in
float64), and prompt batches with different lengths, left-padded like transformers does."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported anywhere

import pytest
import torch

# Tiny models gain nothing from intra-op threads, and on a busy 2-core machine OpenMP
# spin-waiting makes multi-threaded tiny ops many times slower.
torch.set_num_threads(1)

VOCAB = 40


def tiny_llama(layers: int = 2, seed: int = 0, vocab: int = VOCAB, hidden: int = 32, dtype=torch.float64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        attn_implementation="sdpa", bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    return LlamaForCausalLM(config).to(dtype).eval()


def tiny_llava_config(vocab: int = 64, image_token: int = 60):
    """A tiny LLaVA config (CLIP vision tower, 16x16 images, 2x2 patches -> 4 image tokens)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    text = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                              image_size=16, patch_size=8, projection_dim=32)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token,
                       vision_feature_layer=-1, vision_feature_select_strategy="default")


def noisy_copy(model, scale: float, seed: int = 123):
    """A drafter that agrees with `model` part of the time: its weights plus Gaussian noise."""
    import copy

    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device) * scale * p.std().clamp_min(1e-3))
    return other


def left_padded(lengths: list[int], vocab: int = VOCAB, seed: int = 5, pad: int = 0):
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    ids = torch.full((len(lengths), L), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, L - n :] = torch.randint(3, vocab, (n,), generator=g)
        mask[b, L - n :] = 1
    return ids, mask


@pytest.fixture(autouse=True)
def _torch_attention_unless_measured(request):
    """The CPU attention choice (mmspec/cpu_attention.py) decides each shape class from timings,
    so which form a float32 step forward takes depends on what ran before it in the process.
    Tests that are not about that choice run torch's form, so that their bit-for-bit comparisons
    of two calls stay comparisons of the code under test; tests marked `cpu_attention`
    (tests/test_cpu_attention.py) measure and force it themselves."""
    from mmspec import cpu_attention

    if request.node.get_closest_marker("cpu_attention"):
        yield
        return
    with cpu_attention.forced("sdpa"):
        yield


@pytest.fixture(scope="session")
def target():
    return tiny_llama(layers=2, seed=0)


@pytest.fixture(scope="session")
def weak_drafter():
    return tiny_llama(layers=1, seed=1)


@pytest.fixture(scope="session")
def good_drafter(target):
    return noisy_copy(target, 0.3)


def tiny_qwen2vl_config(vocab: int = 64, image_token: int = 60):
    """A tiny Qwen2-VL config: 2x2 patches merged 2x2, so an image of (2h)x(2w) patches gives h*w
    image tokens; M-RoPE sections (1, 1, 2) over head_dim 8; vision start/end tokens 58/59."""
    from transformers import Qwen2VLConfig

    text = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0})
    vision = dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, patch_size=2, spatial_merge_size=2,
                  temporal_patch_size=1, in_channels=3)
    return Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=image_token,
                         video_token_id=image_token + 1, vision_start_token_id=image_token - 2,
                         vision_end_token_id=image_token - 1)
