"""Plain (non-speculative) autoregressive sampling of a LlamaGen c2i GPT, with CFG.

What: the reference decoder for tests, training evaluation and the "plain" baseline: a class
token prefill, then one image token per forward through ``LlamaGenGPT.backbone`` with a
simple preallocated KV cache plugged in through the ``kv`` callable. Classifier-free guidance
as in LlamaGen's ``autoregressive/models/generate.py`` (github.com/FoundationVision/LlamaGen):
the batch is doubled (conditional rows first, then the same number of null-class rows), and
the guided logits ``u + s * (c - u)`` are processed (temperature / top-k / top-p,
``mmspec.sampling``) and sampled once per image; both halves are fed the same sampled token.

CFG schedules (``cfg_scale_at``): ``"constant"`` uses ``s`` at every token (LlamaGen's
sampling scripts); ``"linear"`` ramps the scale from 1 at the first image token to ``s`` at the
last, ``1 + (s - 1) * i / (T - 1)`` (the linear schedule of MAR, Li et al. 2024, written for
raster order; LlamaGen's own scripts only offer the constant scale and ``cfg_interval``).

Limits: one image token per forward (this is the baseline, not the fast path); temperature 0
is greedy (argmax of the guided logits).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from mmspec.sampling import SamplingConfig, process_logits, sample_from

CFG_SCHEDULES = ("constant", "linear")


def check_guidance_scale(scale, name: str = "guidance_scale") -> None:
    """A finite number >= 1. LlamaGen's sampling applies guidance only above 1 (``if cfg_scale >
    1.0``; diffusers' pipelines the same), so a scale below 1 means "no guidance" there, while
    the guided logits ``u + s * (c - u)`` would move toward the unconditional branch: refused
    rather than given either meaning silently."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"{name} must be a finite number, got {scale!r}")
    if scale < 1:
        raise ValueError(f"{name}={scale}: LlamaGen's sampling (and diffusers) apply classifier-free guidance only "
                         f"above 1 and read a scale below 1 as no guidance, while u + s (c - u) would move toward the "
                         f"unconditional branch; pass 1 for no guidance or a scale > 1")


def cfg_scale_at(schedule: str, scale: float, index: int, num_tokens: int) -> float:
    """Guidance scale for image token ``index`` (0-based) of ``num_tokens``."""
    if schedule == "constant":
        return float(scale)
    if schedule == "linear":
        return 1.0 + (float(scale) - 1.0) * (index / max(num_tokens - 1, 1))
    raise ValueError(f"cfg_schedule={schedule!r}: must be one of {CFG_SCHEDULES}")


def guided_logits(logits: torch.Tensor, scale: float) -> torch.Tensor:
    """logits [2B, ..., V] (conditional rows, then unconditional) -> u + s * (c - u) [B, ..., V]."""
    cond, uncond = logits.chunk(2, dim=0)
    return uncond + scale * (cond - uncond)


class SimpleKVCache:
    """Preallocated per-layer K/V [B, n_kv_head, S_max, head_dim]; all rows share one length.
    Call ``cache(layer_idx, k, v)`` as ``backbone``'s ``kv``; ``advance(q)`` after the forward."""

    def __init__(self, n_layer: int, batch: int, n_kv_head: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (batch, n_kv_head, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.length = 0

    def __call__(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        q = k.shape[2]
        end = self.length + q
        if end > self.k[layer_idx].shape[2]:
            raise ValueError(f"KV cache overflow: {end} > {self.k[layer_idx].shape[2]} slots")
        self.k[layer_idx][:, :, self.length:end] = k
        self.v[layer_idx][:, :, self.length:end] = v
        return self.k[layer_idx][:, :, :end], self.v[layer_idx][:, :, :end]

    def advance(self, q: int) -> None:
        self.length += q


@torch.no_grad()
def generate_plain(model, labels: torch.Tensor, num_tokens: Optional[int] = None, cfg_scale: float = 1.0,
                   temperature: float = 1.0, top_k: Optional[int] = None, generator: Optional[torch.Generator] = None,
                   *, top_p: Optional[float] = None, cfg_schedule: str = "constant") -> torch.Tensor:
    """labels [B] -> image tokens [B, num_tokens] (long), raster order. ``num_tokens`` defaults
    to the model's block_size. CFG (doubled batch) whenever the scale differs from 1."""
    args = model.args
    num_tokens = args.block_size if num_tokens is None else int(num_tokens)
    if not 1 <= num_tokens <= args.block_size:
        raise ValueError(f"num_tokens={num_tokens} must be in [1, block_size={args.block_size}]")
    if top_k is not None and top_k > args.vocab_size:
        raise ValueError(f"top_k={top_k} exceeds the codebook size vocab_size={args.vocab_size}")
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    check_guidance_scale(cfg_scale, "cfg_scale")
    scales = [cfg_scale_at(cfg_schedule, cfg_scale, i, num_tokens) for i in range(num_tokens)]
    guided = any(s != 1.0 for s in scales)
    if guided and not args.has_null_class:
        raise ValueError(f"cfg_scale={cfg_scale}: this model has no unconditional (null class) branch "
                         "(class_dropout_prob=0); use cfg_scale=1")
    labels = labels.to(device=model.device, dtype=torch.long)
    b = labels.shape[0]
    if guided:
        labels = torch.cat([labels, torch.full_like(labels, args.num_classes)])
    rows = labels.shape[0]
    dtype = model.tok_embeddings.weight.dtype
    cache = SimpleKVCache(args.n_layer, rows, args.kv_heads, args.cls_token_num + num_tokens, args.head_dim,
                          dtype, labels.device)
    out = torch.empty(b, num_tokens, dtype=torch.long, device=labels.device)
    x = model.class_embed(labels)  # prefill: the class token(s)
    for i in range(num_tokens):
        q = x.shape[1]
        pos = torch.arange(cache.length, cache.length + q, device=labels.device).expand(rows, q)
        slots = torch.arange(cache.length + q, device=labels.device)
        mask = (slots[None, :] <= pos[0][:, None]).expand(rows, q, -1)  # causal over the cache
        logits = model.head(model.backbone(x, model.freqs_at(pos), mask, kv=cache))[:, -1]
        cache.advance(q)
        if guided:
            logits = guided_logits(logits, scales[i])
        tok = sample_from(process_logits(logits, sampling), generator)
        out[:, i] = tok
        nxt = torch.cat([tok, tok]) if guided else tok
        x = model.embed(nxt[:, None])
    return out
