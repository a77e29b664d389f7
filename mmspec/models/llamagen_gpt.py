"""LlamaGen class-conditional (c2i) GPT: a Llama decoder over VQ image tokens with 2-D RoPE.

What: the autoregressive image generator of LlamaGen (Sun et al. 2024, "Autoregressive Model
Beats Diffusion: Llama for Scalable Image Generation", github.com/FoundationVision/LlamaGen,
``autoregressive/models/gpt.py``), written from scratch for mmspec with the SAME parameter
names, so the released c2i checkpoints (``c2i_B_256.pt`` ... ``c2i_3B_384.pt``) load with a
strict ``load_state_dict``. Official key layout (``{L}`` = layer index):

    cls_embedding.embedding_table.weight      [num_classes + 1, dim]  (+1: CFG null class)
    tok_embeddings.weight                     [vocab_size, dim]
    layers.{L}.attention.wqkv.weight          [(n_head + 2 * n_kv_head) * head_dim, dim]
    layers.{L}.attention.wo.weight            [dim, dim]
    layers.{L}.feed_forward.w1/w3.weight      [ffn, dim];  w2.weight [dim, ffn]   (SwiGLU)
    layers.{L}.attention_norm.weight, layers.{L}.ffn_norm.weight, norm.weight   (RMSNorm)
    output.weight                             [vocab_size, dim]

The math follows the official model: pre-norm blocks, RMSNorm computed in float32, fused
q/k/v projection split as [q | k | v], rotary pairs are adjacent channels (2i, 2i+1), keys
and values of a GQA model are repeated with ``repeat_interleave`` (query head h reads kv
head h // (n_head / n_kv_head)). 2-D RoPE: the first half of the rotary pairs rotates with the
token's row, the second half with its column (frequencies ``base ** (-2j / (head_dim / 2))``);
the table has ``cls_token_num`` leading rows of ZEROS (cos = sin = 0) for the class
positions, so the class token's query and key are zeroed by the rotation, exactly as in the
official ``precompute_freqs_cis_2d``; position ``cls_token_num + i`` is image token i in
raster order. The table is computed in float32 like the official one, and never cast to
half precision (it is not a parameter or buffer, like the official ``freqs_cis`` attribute).

Interface used by mmspec's speculative core (batch-first, no global state):

    class_embed(labels [B]) -> [B, cls_token_num, dim]      label == num_classes: null class
    embed(tokens [B, Q]) -> [B, Q, dim]
    freqs_at(positions [B, Q]) -> [B, Q, head_dim // 2, 2] float32 rotary rows
    backbone(x [B, Q, dim], freqs, attn_mask [B, Q, S] | None, kv=None) -> [B, Q, dim]
    head(hidden [B, Q, dim]) -> float logits [B, Q, vocab_size]
    forward(idx [B, T], cond_idx [B], targets=None) -> (logits [B, T + 1, V], loss)

``kv`` is None (plain causal attention over the Q tokens: training, reference) or a callable
``kv(layer_idx, k, v) -> (K, V)`` that receives this step's keys/values [B, n_kv_head, Q,
head_dim] (after RoPE) and returns the cache's full keys/values [B, n_kv_head, S, head_dim]
including them; ``attn_mask`` (True = may attend) then selects the slots. Every query row must
be allowed at least one slot (its own), else scaled-dot-product attention returns NaN.

Limits: c2i only (the t2i caption embedder is a later issue) with ``cls_token_num == 1`` (the
official c2i code path only works with one class token); inference dropout is off in
``eval()``; ``drop_path_rate`` > 0 is supported for training only.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config

from mmspec.models.strict_load import strict_from_pretrained, strip_wrapper_prefix, torch_checkpoint
from mmspec.sampling import draw

KVFn = Callable[[int, torch.Tensor, torch.Tensor], "tuple[torch.Tensor, torch.Tensor]"]


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - (n % k)


@dataclasses.dataclass(frozen=True)
class LlamaGenGPTConfig:
    """The official ``ModelArgs`` fields (same names and defaults) plus validation."""

    dim: int = 4096
    n_layer: int = 32
    n_head: int = 32
    n_kv_head: Optional[int] = None
    multiple_of: int = 256
    ffn_dim_multiplier: Optional[float] = None
    rope_base: float = 10000
    norm_eps: float = 1e-5
    initializer_range: float = 0.02
    token_dropout_p: float = 0.1
    attn_dropout_p: float = 0.0
    resid_dropout_p: float = 0.1
    ffn_dropout_p: float = 0.1
    drop_path_rate: float = 0.0
    num_classes: int = 1000
    caption_dim: int = 2048
    class_dropout_prob: float = 0.1
    model_type: str = "c2i"
    vocab_size: int = 16384
    cls_token_num: int = 1
    block_size: int = 256
    max_batch_size: int = 32
    max_seq_len: int = 2048

    def __post_init__(self) -> None:
        if self.model_type != "c2i":
            raise ValueError(f"model_type={self.model_type!r}: only the class-conditional 'c2i' LlamaGen GPT is "
                             "supported (text-to-image 't2i' is not implemented)")
        if self.cls_token_num != 1:
            raise ValueError(f"cls_token_num={self.cls_token_num}: a c2i LlamaGen GPT has exactly one class token "
                             "(the official c2i code path breaks with more); set cls_token_num=1")
        for name in ("dim", "n_layer", "n_head", "num_classes", "vocab_size", "block_size", "multiple_of"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"LlamaGenGPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.n_head:
            raise ValueError(f"dim={self.dim} is not divisible by n_head={self.n_head}")
        if self.head_dim % 4:
            raise ValueError(f"head_dim = dim / n_head = {self.head_dim} must be a multiple of 4 for LlamaGen's "
                             "2-D RoPE (half the rotary pairs per axis); change dim or n_head")
        kv = self.kv_heads
        if kv < 1 or self.n_head % kv:
            raise ValueError(f"n_kv_head={self.n_kv_head} must divide n_head={self.n_head}")
        grid = math.isqrt(self.block_size)
        if grid * grid != self.block_size:
            raise ValueError(f"block_size={self.block_size} is not a square number of tokens (2-D RoPE grid)")
        if not 0.0 <= self.class_dropout_prob < 1.0:
            raise ValueError(f"class_dropout_prob={self.class_dropout_prob} must be in [0, 1)")
        for name in ("token_dropout_p", "attn_dropout_p", "resid_dropout_p", "ffn_dropout_p", "drop_path_rate"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"LlamaGenGPTConfig.{name}={getattr(self, name)} must be in [0, 1)")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else int(self.n_kv_head)

    @property
    def grid_size(self) -> int:
        return math.isqrt(self.block_size)

    @property
    def ffn_dim(self) -> int:
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return find_multiple(hidden, self.multiple_of)

    @property
    def has_null_class(self) -> bool:
        # Official LabelEmbedder: the CFG row exists iff class_dropout_prob > 0.
        return self.class_dropout_prob > 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Official GPT sizes (``GPT_models`` in gpt.py); c2i checkpoints pair them with an image size.
GPT_PRESETS: dict[str, dict] = {
    "GPT-B": dict(n_layer=12, n_head=12, dim=768),
    "GPT-L": dict(n_layer=24, n_head=16, dim=1024),
    "GPT-XL": dict(n_layer=36, n_head=20, dim=1280),
    "GPT-XXL": dict(n_layer=48, n_head=24, dim=1536),
    "GPT-XXXL": dict(n_layer=48, n_head=40, dim=2560),
    "GPT-3B": dict(n_layer=24, n_head=32, dim=3200),
}
# Released c2i checkpoints, named as their files: (GPT size, image size); VQ-16 downsamples by
# 16, codebook 16384. The grid is not visible in the weights (a 384-px file loads under a 256-px
# preset and generates the wrong grid), so every released file has its own preset. "c2i_X_384":
# the official README's link text for c2i_XL_384.pt, kept as an alias.
C2I_CHECKPOINTS: dict[str, tuple[str, int]] = {
    "c2i_B_256": ("GPT-B", 256), "c2i_B_384": ("GPT-B", 384), "c2i_L_256": ("GPT-L", 256),
    "c2i_L_384": ("GPT-L", 384), "c2i_XL_384": ("GPT-XL", 384), "c2i_X_384": ("GPT-XL", 384),
    "c2i_XXL_384": ("GPT-XXL", 384), "c2i_3B_384": ("GPT-3B", 384),
}


def preset_config(name: str, **overrides) -> LlamaGenGPTConfig:
    """``"c2i_B_256"`` ... ``"c2i_3B_384"`` or a bare size ``"GPT-B"`` (block_size 256)."""
    if name in C2I_CHECKPOINTS:
        size, image = C2I_CHECKPOINTS[name]
        base = dict(GPT_PRESETS[size], vocab_size=16384, num_classes=1000, block_size=(image // 16) ** 2)
    elif name in GPT_PRESETS:
        base = dict(GPT_PRESETS[name])
    else:
        raise ValueError(f"unknown LlamaGen preset {name!r}; known: {sorted(C2I_CHECKPOINTS) + sorted(GPT_PRESETS)}")
    base.update(overrides)
    return LlamaGenGPTConfig(**base)


def precompute_freqs_cis_2d(grid_size: int, head_dim: int, base: float, cls_token_num: int) -> torch.Tensor:
    """Rotary table [cls_token_num + grid_size**2, head_dim // 2, 2] (cos, sin), float32 as the
    official; row ``cls_token_num + r * grid_size + c`` is grid cell (row r, column c)."""
    half = head_dim // 2
    inv = 1.0 / (base ** (torch.arange(0, half, 2, dtype=torch.float32)[: half // 2] / half))
    ang = torch.outer(torch.arange(grid_size, dtype=torch.float32), inv)  # [G, head_dim // 4]
    rows = ang[:, None, :].expand(grid_size, grid_size, -1)
    cols = ang[None, :, :].expand(grid_size, grid_size, -1)
    grid = torch.cat([rows, cols], dim=-1).flatten(0, 1)  # [G*G, head_dim // 2]
    table = torch.stack([grid.cos(), grid.sin()], dim=-1)
    return torch.cat([torch.zeros(cls_token_num, half, 2), table])


def apply_rotary(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x [B, Q, H, D], freqs [B, Q, D // 2, 2] (cos, sin) -> x rotated pairwise, in x's dtype (the
    math in float32, or float64 for a float64 model). One complex multiply per pair, as the
    official `apply_rotary_emb` (6x faster on CPU than the same math as separate real ops)."""
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    xs = torch.view_as_complex(x.to(dt).reshape(*x.shape[:-1], -1, 2))
    f = torch.view_as_complex(freqs.to(dt).contiguous()).unsqueeze(2)  # [B, Q, 1, D // 2]
    return torch.view_as_real(xs * f).flatten(3).to(x.dtype)


class LabelEmbedder(nn.Module):
    """Class label -> [B, 1, dim]; row ``num_classes`` is the CFG null class (if dropout > 0)."""

    def __init__(self, num_classes: int, hidden_size: int, dropout_prob: float):
        super().__init__()
        self.embedding_table = nn.Embedding(num_classes + int(dropout_prob > 0), hidden_size)
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        return self.embedding_table(labels).unsqueeze(1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.float16, torch.bfloat16):  # normalise in float32, scale in x's dtype (official)
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # same math, one fused op


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaGenGPTConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.ffn_dropout = nn.Dropout(cfg.ffn_dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn_dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))


class Attention(nn.Module):
    def __init__(self, cfg: LlamaGenGPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim, self.dim = cfg.n_head, cfg.kv_heads, cfg.head_dim, cfg.dim
        self.wqkv = nn.Linear(cfg.dim, (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.attn_dropout_p = cfg.attn_dropout_p
        self.resid_dropout = nn.Dropout(cfg.resid_dropout_p)

    def forward(self, x, freqs, attn_mask, kv: Optional[KVFn], layer_idx: int, attend=None) -> torch.Tensor:
        b, q_len, _ = x.shape
        kv_size = self.n_kv_head * self.head_dim
        xqk, xv = self.wqkv(x).split([self.dim + kv_size, kv_size], dim=-1)
        xqk = apply_rotary(xqk.view(b, q_len, self.n_head + self.n_kv_head, self.head_dim), freqs)  # q and k at once
        xq, xk = xqk.split([self.n_head, self.n_kv_head], dim=2)
        xq, xk = xq.transpose(1, 2), xk.transpose(1, 2)
        xv = xv.view(b, q_len, self.n_kv_head, self.head_dim).transpose(1, 2)
        if kv is not None:
            keys, values = kv(layer_idx, xk, xv)
        else:
            keys, values = xk, xv

        def torch_path():
            k, v = keys, values
            rep = self.n_head // self.n_kv_head
            if rep > 1:
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            mask = None if attn_mask is None else attn_mask.unsqueeze(1)  # [B, 1, Q, S]
            return F.scaled_dot_product_attention(xq, k, v, attn_mask=mask, is_causal=attn_mask is None,
                                                  dropout_p=self.attn_dropout_p if self.training else 0.0)

        # `attend(q, k, v, torch_path)`: a caller's choice of attention form for the same inputs
        # (mmspec's step forwards on CPU: mmspec/cpu_attention.py); kv heads not repeated.
        out = torch_path() if attend is None or self.training else attend(xq, keys, values, torch_path)
        return self.resid_dropout(self.wo(out.transpose(1, 2).reshape(b, q_len, self.dim)))


class DropPath(nn.Module):
    """Stochastic depth (per sample); identity in eval mode."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = x.new_empty(x.shape[0], *([1] * (x.dim() - 1))).bernoulli_(1.0 - self.p)
        return x * keep / (1.0 - self.p)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaGenGPTConfig, drop_path: float):
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x, freqs, attn_mask, kv, layer_idx, attend=None):
        h = x + self.drop_path(self.attention(self.attention_norm(x), freqs, attn_mask, kv, layer_idx, attend))
        return h + self.drop_path(self.feed_forward(self.ffn_norm(h)))


class LlamaGenGPT(ModelMixin, ConfigMixin):
    """LlamaGen c2i GPT (see module docstring). ``LlamaGenGPT.from_args(preset_config("c2i_B_256"))``,
    ``LlamaGenGPT.from_official(path, "c2i_B_256")``, or diffusers ``from_pretrained(folder)``."""

    config_name = "config.json"
    _supports_gradient_checkpointing = False

    @register_to_config
    def __init__(self, dim: int = 4096, n_layer: int = 32, n_head: int = 32, n_kv_head: Optional[int] = None,
                 multiple_of: int = 256, ffn_dim_multiplier: Optional[float] = None, rope_base: float = 10000,
                 norm_eps: float = 1e-5, initializer_range: float = 0.02, token_dropout_p: float = 0.1,
                 attn_dropout_p: float = 0.0, resid_dropout_p: float = 0.1, ffn_dropout_p: float = 0.1,
                 drop_path_rate: float = 0.0, num_classes: int = 1000, caption_dim: int = 2048,
                 class_dropout_prob: float = 0.1, model_type: str = "c2i", vocab_size: int = 16384,
                 cls_token_num: int = 1, block_size: int = 256, max_batch_size: int = 32, max_seq_len: int = 2048):
        super().__init__()
        args = LlamaGenGPTConfig(**{f.name: v for f, v in zip(dataclasses.fields(LlamaGenGPTConfig), (
            dim, n_layer, n_head, n_kv_head, multiple_of, ffn_dim_multiplier, rope_base, norm_eps,
            initializer_range, token_dropout_p, attn_dropout_p, resid_dropout_p, ffn_dropout_p, drop_path_rate,
            num_classes, caption_dim, class_dropout_prob, model_type, vocab_size, cls_token_num, block_size,
            max_batch_size, max_seq_len))})
        self.args = args
        self.cls_embedding = LabelEmbedder(args.num_classes, args.dim, args.class_dropout_prob)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.tok_dropout = nn.Dropout(args.token_dropout_p)
        rates = torch.linspace(0, args.drop_path_rate, args.n_layer).tolist()
        self.layers = nn.ModuleList(TransformerBlock(args, rates[i]) for i in range(args.n_layer))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Plain attribute (not a buffer): float32, absent from the state dict, never cast by .half().
        self._freqs = precompute_freqs_cis_2d(args.grid_size, args.head_dim, args.rope_base, args.cls_token_num)
        self._init_weights()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """diffusers' loader, strict: a missing, unexpected or mis-shaped key is a ValueError naming it."""
        return strict_from_pretrained(super().from_pretrained, cls.__name__, pretrained_model_name_or_path, *args, **kwargs)

    @classmethod
    def from_args(cls, args: LlamaGenGPTConfig) -> "LlamaGenGPT":
        return cls(**args.to_dict())

    def _init_weights(self) -> None:
        # Official initialisation: N(0, initializer_range) for linear / embedding, zero output layer.
        std = self.args.initializer_range
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, std)
        nn.init.zeros_(self.output.weight)

    # ------------------------------------------------------------------ core interface
    @property
    def seq_len(self) -> int:
        """Rows of the rotary table: class positions + image tokens."""
        return self.args.cls_token_num + self.args.block_size

    def class_embed(self, labels: torch.Tensor) -> torch.Tensor:
        """labels [B] (long; ``num_classes`` = null class) -> [B, cls_token_num, dim]. No dropout."""
        if labels.dim() != 1:
            raise ValueError(f"labels must be [B], got shape {tuple(labels.shape)}")
        top = self.args.num_classes + int(self.args.has_null_class)
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= top):
            null = (f"or {self.args.num_classes} for the unconditional (CFG null) class" if self.args.has_null_class
                    else "(this model has no CFG null class: class_dropout_prob=0)")
            raise ValueError(f"class labels {labels.tolist()} out of range: must be in [0, {self.args.num_classes}) "
                             + null)
        return self.cls_embedding(labels)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, Q] (image token ids) -> [B, Q, dim]."""
        return self.tok_embeddings(tokens)

    def freqs_at(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [B, Q] (0 = class token, cls_token_num + i = image token i) -> float32 rotary
        rows [B, Q, head_dim // 2, 2] on the positions' device."""
        if self._freqs.device != positions.device:
            self._freqs = self._freqs.to(positions.device)
        return self._freqs[positions]

    def backbone(self, x: torch.Tensor, freqs: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                 kv: Optional[KVFn] = None, attend=None) -> torch.Tensor:
        """x [B, Q, dim] embeddings, freqs [B, Q, head_dim // 2, 2] -> hidden [B, Q, dim] after
        the final norm. kv=None: causal over the Q tokens (or ``attn_mask`` [B, Q, Q]); with a
        ``kv`` callable, ``attn_mask`` [B, Q, S] (True = may attend) is required. ``attend``
        (eval mode only): ``attend(q, k, v, torch_path)`` computes each layer's attention instead
        of ``torch_path()`` (q [B, H, Q, hd], k / v [B, kv heads, S, hd])."""
        if kv is not None and attn_mask is None:
            raise ValueError("backbone(kv=...) needs attn_mask [B, Q, S] over the cache slots kv returns")
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            raise TypeError(f"attn_mask must be a bool tensor (True = may attend), got {attn_mask.dtype}")
        h = x
        for i, layer in enumerate(self.layers):
            h = layer(h, freqs, attn_mask, kv, i, attend)
        return self.norm(h)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, Q, dim] -> float logits [B, Q, vocab_size] (float64 for a float64 model)."""
        logits = self.output(hidden)
        return logits if logits.dtype == torch.float64 else logits.float()

    # ------------------------------------------------------------------ training forward
    def drop_labels(self, labels: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Class dropout for CFG training: each label becomes the null class with probability
        ``class_dropout_prob`` (official LabelEmbedder.token_drop)."""
        p = self.args.class_dropout_prob
        if p == 0:
            return labels
        drop = draw(torch.rand, labels.shape[0], generator=generator, device=labels.device) < p
        return torch.where(drop, torch.full_like(labels, self.args.num_classes), labels)

    def forward(self, idx: torch.Tensor, cond_idx: torch.Tensor, targets: Optional[torch.Tensor] = None,
                valid: Optional[torch.Tensor] = None, generator: Optional[torch.Generator] = None):
        """Teacher-forced pass: idx [B, T] image tokens (T <= block_size - 1 when training on
        whole images: inputs are tokens 0..T-1), cond_idx [B] labels -> (logits [B, T + 1, V],
        loss or None). Logit row j predicts image token j. In training mode labels are dropped
        to the null class with ``class_dropout_prob``; ``valid`` [B] masks rows out of the loss."""
        if idx.dim() != 2 or cond_idx.dim() != 1 or idx.shape[0] != cond_idx.shape[0]:
            raise ValueError(f"idx must be [B, T] and cond_idx [B]; got {tuple(idx.shape)} and {tuple(cond_idx.shape)}")
        n = self.args.cls_token_num + idx.shape[1]
        if n > self.seq_len:
            raise ValueError(f"{idx.shape[1]} image tokens exceed block_size={self.args.block_size}")
        labels = self.drop_labels(cond_idx, generator) if self.training else cond_idx
        h = self.tok_dropout(torch.cat([self.class_embed(labels), self.embed(idx)], dim=1))
        positions = torch.arange(n, device=idx.device).expand(idx.shape[0], n)
        logits = self.head(self.backbone(h, self.freqs_at(positions)))[:, self.args.cls_token_num - 1:]
        loss = None
        if targets is not None:
            flat = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
            if valid is not None:
                w = valid.to(flat.dtype)[:, None].expand(targets.shape).reshape(-1)
                loss = (flat * w).sum() / w.sum().clamp_min(1)
            else:
                loss = flat.mean()
        return logits, loss

    # ------------------------------------------------------------------ official checkpoints
    @classmethod
    def from_official(cls, checkpoint, config: "str | LlamaGenGPTConfig") -> "LlamaGenGPT":
        """Load an official LlamaGen c2i checkpoint (a path to ``.pt`` / ``.safetensors`` or a
        loaded object): weights under ``model`` / ``module`` / ``ema`` / ``state_dict`` or raw.
        ``config``: a preset name (``"c2i_B_256"``) or a LlamaGenGPTConfig. Strict: missing,
        unexpected or mis-shaped keys -> ValueError naming them. The image grid is not in the
        weights: a file that records its training `args` (LlamaGen's train_c2i.py saves them)
        must agree with ``config`` on the grid, vocabulary and classes, else ValueError."""
        args = preset_config(config) if isinstance(config, str) else config
        if not isinstance(args, LlamaGenGPTConfig):
            raise TypeError(f"config must be a preset name or LlamaGenGPTConfig, got {type(config).__name__}")
        loaded = _checkpoint_object(checkpoint)
        check_training_args(loaded, args)
        state = official_state_dict(loaded)
        model = cls.from_args(args)
        load_strict(model, state, where=str(checkpoint) if isinstance(checkpoint, (str, Path)) else "checkpoint")
        return model.eval()


def _checkpoint_object(checkpoint):
    """A path's loaded object (weights-only), or the object itself."""
    if not isinstance(checkpoint, (str, Path)):
        return checkpoint
    path = Path(checkpoint)
    if not path.is_file():
        raise ValueError(f"no such checkpoint file: {path}")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch_checkpoint(path)


def check_training_args(checkpoint, config: LlamaGenGPTConfig) -> None:
    """A checkpoint saved by LlamaGen's training script carries its `args` (image_size,
    downsample_size, vocab_size, num_classes, cls_token_num, gpt_type): refuse a config that
    disagrees, naming the preset that fits (the grid was silently taken from the config)."""
    saved = checkpoint.get("args") if isinstance(checkpoint, dict) else None
    if saved is None:
        return
    get = (lambda k: saved.get(k)) if isinstance(saved, dict) else (lambda k: getattr(saved, k, None))
    wrong = []
    size, down = get("image_size"), get("downsample_size")
    size = int(size) if isinstance(size, numbers.Integral) else size  # (NumPy ints too)
    down = int(down) if isinstance(down, numbers.Integral) else down
    if isinstance(size, int) and isinstance(down, int) and down > 0 and (size // down) ** 2 != config.block_size:
        wrong.append(f"image_size {size} / downsample_size {down} -> {(size // down) ** 2} image tokens, the config's "
                     f"block_size {config.block_size}")
    for key, field in (("vocab_size", "vocab_size"), ("num_classes", "num_classes"),
                       ("cls_token_num", "cls_token_num"), ("gpt_type", "model_type")):
        value = get(key)
        if value is not None and value != getattr(config, field):
            wrong.append(f"{key} {value!r}, the config's {field} {getattr(config, field)!r}")
    if wrong:
        model = get("gpt_model")
        released = all(get(k) in (None, v) for k, v in (("vocab_size", 16384), ("num_classes", 1000),
                                                        ("cls_token_num", 1)))
        fits = [name for name, (m, image) in C2I_CHECKPOINTS.items()
                if (m, image) == (model, size) and down == 16 and released]
        if get("gpt_type") not in (None, "c2i"):
            hint = f"; gpt_type {get('gpt_type')!r} is not supported (class-conditional 'c2i' only)"
        elif fits:
            hint = f"; use preset {fits[0]!r}"
        elif model in GPT_PRESETS and isinstance(size, int) and isinstance(down, int) and down > 0:
            extra = "".join(f", {field}={get(key)!r}" for key, field in (("vocab_size", "vocab_size"),
                            ("num_classes", "num_classes")) if get(key) is not None)
            hint = f"; use preset_config({model!r}, block_size={(size // down) ** 2}{extra})"
        else:
            hint = "; pass a LlamaGenGPTConfig that matches"
        raise ValueError("the checkpoint's training args disagree with the config: " + "; ".join(wrong) + hint)


def official_state_dict(checkpoint) -> dict[str, torch.Tensor]:
    """The state dict inside an official checkpoint (path or loaded object)."""
    obj = _checkpoint_object(checkpoint)
    if isinstance(obj, dict):
        for key in ("model", "module", "ema", "state_dict"):
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict) or not obj or not all(torch.is_tensor(v) for v in obj.values()):
        raise ValueError("unknown checkpoint format: expected a state dict or "
                         "{'model' | 'module' | 'ema' | 'state_dict': state dict}")
    obj = strip_wrapper_prefix(obj)
    if "tok_embeddings.weight" not in obj or "cls_embedding.embedding_table.weight" not in obj:
        raise ValueError("not a LlamaGen c2i GPT checkpoint: it lacks tok_embeddings.weight / "
                         f"cls_embedding.embedding_table.weight (first keys: {sorted(obj)[:6]})")
    return obj


def load_strict(model: nn.Module, state: dict[str, torch.Tensor], where: str = "checkpoint") -> None:
    """load_state_dict(strict) that reports missing / unexpected / mis-shaped keys as ValueError."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
              for k in sorted(set(own) & set(state)) if state[k].shape != own[k].shape]
    if missing or unexpected or shapes:
        cut = lambda xs: f"{xs[:8]}{' ... (%d in all)' % len(xs) if len(xs) > 8 else ''}"
        raise ValueError(f"{where} does not match the LlamaGen GPT config: missing keys {cut(missing)}, "
                         f"unexpected keys {cut(unexpected)}, shape mismatches {cut(shapes)}")
    model.load_state_dict(state, strict=True)
