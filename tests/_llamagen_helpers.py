"""Tiny random LlamaGen c2i GPTs (float64) and reference decoding for the speculative tests."""

from __future__ import annotations

import torch

from mmspec.models.llamagen_gpt import LlamaGenGPT, LlamaGenGPTConfig
from mmspec.models.llamagen_sample import generate_plain

NUM_CLASSES = 5


def tiny_gpt(seed: int = 0, *, vocab: int = 24, layers: int = 2, dim: int = 32, heads: int = 4, kv_heads=None,
             block: int = 16, null_class: bool = True, scale: float = 0.3, dtype=torch.float64) -> LlamaGenGPT:
    cfg = LlamaGenGPTConfig(dim=dim, n_layer=layers, n_head=heads, n_kv_head=kv_heads, multiple_of=16,
                            vocab_size=vocab, num_classes=NUM_CLASSES, block_size=block,
                            class_dropout_prob=0.1 if null_class else 0.0)
    torch.manual_seed(seed)
    model = LlamaGenGPT.from_args(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # the official init zeroes the output layer; randomise everything
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale + (1.0 if p.dim() == 1 else 0.0))
    return model.to(dtype).eval()


def noisy_gpt(model: LlamaGenGPT, noise: float, seed: int = 1) -> LlamaGenGPT:
    """A copy of `model` with relative Gaussian noise on every weight: a drafter that agrees often."""
    other = LlamaGenGPT.from_args(model.args).to(model.dtype).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p, q in zip(other.parameters(), model.parameters()):
            p.copy_(q + noise * q.abs().mean() * torch.randn(q.shape, generator=g, dtype=q.dtype))
    return other


LABELS = torch.tensor([0, 3, 1, 4])  # batch of 4, mixed classes


def plain_greedy(model, labels=LABELS, scale: float = 1.0, schedule: str = "constant", n=None) -> torch.Tensor:
    return generate_plain(model, labels, n, cfg_scale=scale, temperature=0, cfg_schedule=schedule)
