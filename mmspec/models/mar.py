"""MAR: masked autoregressive image generation with continuous tokens and a diffusion head.

Source: Li et al., "Autoregressive Image Generation without Vector Quantization" (NeurIPS
2024, arXiv 2406.11838); public code github.com/LTH14/mar (`models/mar.py`). This is a
re-implementation whose parameter names are the official ones, so `checkpoint-last.pth`
(`{"model": ..., "model_ema": ...}`) loads strictly (`MARModel.from_official`).

Architecture: a bidirectional ViT encoder over the known tokens plus `buffer_size` buffer
positions that all carry the class embedding (or the learned `fake_latent` for the
unconditional branch of classifier-free guidance; dropped with `label_drop_prob` in training),
a ViT decoder over all positions (mask tokens where unknown), and the per-token diffusion
head (`mar_diffloss.DiffLoss`) conditioned on the decoder output. Generation reveals tokens
in a random order over `num_iter` steps with the cosine masking schedule of MaskGIT
(`mar_schedule`).

Difference from the official code (same result): unknown tokens are excluded from the
encoder by a key mask over a per-row gather instead of by dropping them, so rows of one batch
may know different numbers of tokens (the speculative sampler needs that).

Limits: inference and a plain training loss; no gradient checkpointing, no EMA bookkeeping.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin

from mmspec.models.mar_diffloss import DiffLoss
from mmspec.models.strict_load import torch_checkpoint
from mmspec.sampling import draw

# Official variants (models/mar.py `mar_base/large/huge`; diffusion-head sizes of the
# released checkpoints per the official README).
MAR_VARIANTS = {
    "mar_base": dict(encoder_embed_dim=768, encoder_depth=12, encoder_num_heads=12, decoder_embed_dim=768,
                     decoder_depth=12, decoder_num_heads=12, diffloss_d=6, diffloss_w=1024),
    "mar_large": dict(encoder_embed_dim=1024, encoder_depth=16, encoder_num_heads=16, decoder_embed_dim=1024,
                      decoder_depth=16, decoder_num_heads=16, diffloss_d=8, diffloss_w=1280),
    "mar_huge": dict(encoder_embed_dim=1280, encoder_depth=20, encoder_num_heads=16, decoder_embed_dim=1280,
                     decoder_depth=20, decoder_num_heads=16, diffloss_d=12, diffloss_w=1536),
}


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        mask = None if key_mask is None else key_mask[:, None, None, :]  # [B, 1, 1, N] True = attend
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm ViT block with timm's `Block` parameter names."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), key_mask)
        return x + self.mlp(self.norm2(x))

    def forward_at(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The block's output at the positions idx [B, M] only (every position still serves as
        key and value): [B, M, C], equal to `forward(x).gather(1, idx)` with the query-side
        projections, the attention rows and the MLP computed for M positions instead of N."""
        B, N, C = x.shape
        a, H = self.attn, self.attn.heads
        h = self.norm1(x)
        kv = F.linear(h, a.qkv.weight[C:], a.qkv.bias[C:]).reshape(B, N, 2, H, C // H).permute(2, 0, 3, 1, 4)
        x_q = x.gather(1, idx[..., None].expand(-1, -1, C))
        q = F.linear(h.gather(1, idx[..., None].expand(-1, -1, C)), a.qkv.weight[:C], a.qkv.bias[:C])
        q = q.reshape(B, -1, H, C // H).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, kv[0], kv[1])
        x_q = x_q + a.proj(o.transpose(1, 2).reshape(B, -1, C))
        return x_q + self.mlp(self.norm2(x_q))


def mar_schedule(seq_len: int, num_iter: int) -> tuple[list[int], list[int]]:
    """Cosine masking schedule of the official sampler.
    -> (masked [num_iter + 1]: tokens still unknown before step s (masked[num_iter] = 0),
        mask_len [num_iter]: the official `mask_len` of step s, which the linear CFG schedule uses).
    With the generation order `order`, step s reveals `order[masked[s + 1]:masked[s]]`."""
    if not isinstance(num_iter, int) or isinstance(num_iter, bool) or not 1 <= num_iter <= seq_len:
        raise ValueError(f"num_iter must be an int in [1, {seq_len}] (the number of tokens), got {num_iter!r}")
    masked, lens = [seq_len], []
    for step in range(num_iter):
        ratio = np.cos(math.pi / 2.0 * (step + 1) / num_iter)
        mask_len = max(1, min(masked[-1] - 1, int(np.floor(seq_len * ratio))))
        lens.append(mask_len)
        masked.append(0 if step == num_iter - 1 else mask_len)
    return masked, lens



def sampling_steps(value) -> int:
    """The diffusion head's `num_sampling_steps`: an int in [2, 1000], or its digits as a string
    (the official code takes a string). A float was truncated (100.7 ran 100 steps) and the
    official "ddimN" / comma-separated respacings failed inside int(); both are refused."""
    steps = int(value) if isinstance(value, str) and value.strip().isdigit() else value
    if isinstance(steps, bool) or not isinstance(steps, int) or not 2 <= steps <= 1000:
        extra = ("; 'ddimN' and comma-separated respacings are not supported: give the number of evenly strided "
                 "steps" if isinstance(value, str) else "")
        raise ValueError(f"num_sampling_steps must be an int in [2, 1000], got {value!r}{extra}")
    return steps

class MARModel(ModelMixin, ConfigMixin):
    """MAR encoder / decoder / diffusion head (official key names)."""

    @register_to_config
    def __init__(
        self,
        img_size: int = 256,
        vae_stride: int = 16,
        patch_size: int = 1,
        encoder_embed_dim: int = 1024,
        encoder_depth: int = 16,
        encoder_num_heads: int = 16,
        decoder_embed_dim: int = 1024,
        decoder_depth: int = 16,
        decoder_num_heads: int = 16,
        mlp_ratio: float = 4.0,
        vae_embed_dim: int = 16,
        mask_ratio_min: float = 0.7,
        label_drop_prob: float = 0.1,
        class_num: int = 1000,
        buffer_size: int = 64,
        diffloss_d: int = 3,
        diffloss_w: int = 1024,
        num_sampling_steps: int = 100,
        diffusion_batch_mul: int = 4,
        diffloss_clip_x0: float | None = None,
    ) -> None:
        super().__init__()
        num_sampling_steps = sampling_steps(num_sampling_steps)
        self.register_to_config(num_sampling_steps=num_sampling_steps)  # the int ("25" was kept as given)
        if img_size % (vae_stride * patch_size):
            raise ValueError(f"img_size={img_size} must be divisible by vae_stride * patch_size = {vae_stride * patch_size}")
        for name, dim, heads in (("encoder", encoder_embed_dim, encoder_num_heads), ("decoder", decoder_embed_dim, decoder_num_heads)):
            if dim % heads:
                raise ValueError(f"{name}_embed_dim={dim} must be divisible by {name}_num_heads={heads}")
        self.seq_h = self.seq_w = img_size // vae_stride // patch_size
        self.seq_len = self.seq_h * self.seq_w
        self.token_embed_dim = vae_embed_dim * patch_size**2
        E, Dd, L = encoder_embed_dim, decoder_embed_dim, self.seq_len
        self.class_emb = nn.Embedding(class_num, E)
        self.fake_latent = nn.Parameter(torch.zeros(1, E))
        self.z_proj = nn.Linear(self.token_embed_dim, E)
        self.z_proj_ln = nn.LayerNorm(E, eps=1e-6)
        self.encoder_pos_embed_learned = nn.Parameter(torch.zeros(1, L + buffer_size, E))
        self.encoder_blocks = nn.ModuleList(Block(E, encoder_num_heads, mlp_ratio) for _ in range(encoder_depth))
        self.encoder_norm = nn.LayerNorm(E, eps=1e-6)
        self.decoder_embed = nn.Linear(E, Dd)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, Dd))
        self.decoder_pos_embed_learned = nn.Parameter(torch.zeros(1, L + buffer_size, Dd))
        self.decoder_blocks = nn.ModuleList(Block(Dd, decoder_num_heads, mlp_ratio) for _ in range(decoder_depth))
        self.decoder_norm = nn.LayerNorm(Dd, eps=1e-6)
        self.diffusion_pos_embed_learned = nn.Parameter(torch.zeros(1, L, Dd))
        self._init_weights()
        # diffloss_clip_x0: not in the official code (None = official sampler); see mar_diffloss
        self.diffloss = DiffLoss(self.token_embed_dim, Dd, diffloss_d, diffloss_w, num_sampling_steps, diffloss_clip_x0)

    def _init_weights(self) -> None:
        for p in (self.class_emb.weight, self.fake_latent, self.mask_token, self.encoder_pos_embed_learned,
                  self.decoder_pos_embed_learned, self.diffusion_pos_embed_learned):
            nn.init.normal_(p, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    # -- layout helpers ------------------------------------------------------------------

    def patchify(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, H, W] -> [B, L, C p p]
        B, C, H, W = x.shape
        p = self.config.patch_size
        x = x.reshape(B, C, H // p, p, W // p, p)
        return torch.einsum("nchpwq->nhwcpq", x).reshape(B, (H // p) * (W // p), C * p * p)

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:  # [B, L, C p p] -> [B, C, H, W]
        B = x.shape[0]
        p, c = self.config.patch_size, self.config.vae_embed_dim
        x = x.reshape(B, self.seq_h, self.seq_w, c, p, p)
        return torch.einsum("nhwcpq->nchpwq", x).reshape(B, c, self.seq_h * p, self.seq_w * p)

    def class_embedding(self, class_labels: torch.Tensor | None, batch: int) -> torch.Tensor:
        """[B, E]: class embeddings, or the unconditional `fake_latent` when labels are None."""
        if class_labels is None:
            return self.fake_latent.expand(batch, -1)
        return self.class_emb(class_labels)

    # -- forward -------------------------------------------------------------------------

    def forward_z(self, tokens: torch.Tensor, known: torch.Tensor, class_embedding: torch.Tensor,
                  need: torch.Tensor | None = None) -> torch.Tensor:
        """Conditioning of the diffusion head for every position.
        tokens [B, L, D]; known [B, L] bool (True = given to the encoder); class_embedding
        [B, E] -> z [B, L, Dd]. Rows may know different numbers of tokens.
        `need` [B, L] bool: only these positions' z are wanted; the last decoder block then runs
        its queries, attention rows and MLP at those positions only (samplers need a few of the
        L per step) and z is NaN everywhere else, so that a stray use cannot pass unnoticed."""
        B, L, _ = tokens.shape
        if need is not None and tuple(need.shape) != (B, L):
            raise ValueError(f"need must be a [batch, tokens] = [{B}, {L}] mask of the positions whose z is wanted, "
                             f"got shape {tuple(need.shape)}")
        buf = self.config.buffer_size
        x = self.z_proj(tokens)
        x = torch.cat([class_embedding[:, None, :].to(x.dtype).expand(B, buf, -1), x], 1)
        x = self.z_proj_ln(x + self.encoder_pos_embed_learned)
        keep = torch.cat([torch.ones(B, buf, dtype=torch.bool, device=x.device), known.bool()], 1)  # [B, buf+L]
        n_keep = keep.sum(1)
        N = int(n_keep.max())  # SYNC: padded length of the gathered known tokens
        idx = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :N]  # known first, in position order
        valid = torch.arange(N, device=x.device)[None] < n_keep[:, None]  # [B, N]
        h = x.gather(1, idx[..., None].expand(-1, -1, x.shape[-1]))
        mask = None if bool(valid.all()) else valid  # SYNC: skip the mask when no row is padded
        for block in self.encoder_blocks:
            h = block(h, mask)
        h = self.decoder_embed(self.encoder_norm(h))
        # scatter back; padded slots go to a dummy position buf+L that is dropped
        full = self.mask_token.to(h.dtype).expand(B, buf + L + 1, -1).clone()
        dest = torch.where(valid, idx, torch.full_like(idx, buf + L))
        full.scatter_(1, dest[..., None].expand(-1, -1, h.shape[-1]), h)
        y = full[:, : buf + L] + self.decoder_pos_embed_learned
        if need is None or not len(self.decoder_blocks):
            for block in self.decoder_blocks:
                y = block(y)
            y = self.decoder_norm(y)[:, buf:] + self.diffusion_pos_embed_learned
            return y if need is None else y.masked_fill(~need.bool()[..., None], float("nan"))
        need = need.bool()
        n_need = need.sum(1)
        M = max(1, int(n_need.max()))  # SYNC: padded count of wanted positions
        q_idx = torch.argsort((~need).to(torch.int8), dim=1, stable=True)[:, :M]  # wanted first
        for block in self.decoder_blocks[:-1]:
            y = block(y)
        y = self.decoder_norm(self.decoder_blocks[-1].forward_at(y, q_idx + buf))
        y = y + self.diffusion_pos_embed_learned[0][q_idx]
        out = torch.full((B, L + 1, y.shape[-1]), float("nan"), dtype=y.dtype, device=y.device)
        dest = torch.where(torch.arange(M, device=y.device)[None] < n_need[:, None], q_idx, torch.full_like(q_idx, L))
        out.scatter_(1, dest[..., None].expand(-1, -1, y.shape[-1]), y)
        return out[:, :L]

    def forward(self, latents: torch.Tensor, class_labels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Training loss (scalar) on VAE latents [B, C, H, W] (already scaled), as the official
        `MAR.forward`: random order, a mask ratio from the truncated Gaussian on
        [mask_ratio_min, 1] (mean 1, std 0.25), class dropout, the diffusion loss on the
        masked tokens with `diffusion_batch_mul` noise draws per token. Not the official blocks'
        attention / projection dropout (0.1): this model has no dropout (inference is the same)."""
        cfg = self.config
        x = self.patchify(latents)
        B, L, D = x.shape
        dev = x.device
        order = draw(torch.rand, B, L, generator=generator, device=dev).argsort(1)
        while True:  # truncated normal by rejection (acceptance ~ 0.4)
            r = 1.0 + 0.25 * float(draw(torch.randn, 1, generator=generator, device=dev))
            if cfg.mask_ratio_min <= r <= 1.0:
                break
        n_mask = int(math.ceil(L * r))
        masked = torch.zeros(B, L, dtype=torch.bool, device=dev)
        masked.scatter_(1, order[:, :n_mask], True)
        emb = self.class_emb(class_labels)
        drop = (draw(torch.rand, B, generator=generator, device=dev) < cfg.label_drop_prob)[:, None]
        emb = torch.where(drop, self.fake_latent.expand(B, -1), emb)
        z = self.forward_z(x, ~masked, emb)
        mul = cfg.diffusion_batch_mul
        zm, tm = z[masked].repeat(mul, 1), x[masked].repeat(mul, 1)
        return self.diffloss.loss(tm, zm, generator).mean()

    def set_num_sampling_steps(self, num_sampling_steps: int) -> "MARModel":
        """Sample the diffusion head in `num_sampling_steps` respaced steps from now on (the
        official `num_sampling_steps`, an inference setting: the weights do not change). A CSpD
        drafter with fewer steps than its target drafts faster."""
        num_sampling_steps = sampling_steps(num_sampling_steps)
        self.diffloss.set_num_sampling_steps(num_sampling_steps)
        self.register_to_config(num_sampling_steps=num_sampling_steps)
        return self

    # -- official checkpoints ------------------------------------------------------------

    @classmethod
    def from_official(cls, checkpoint, variant: str | None = None, *, use_ema: bool = True,
                      torch_dtype: torch.dtype | None = None, **config) -> "MARModel":
        """Load an official `checkpoint-last.pth` (path or loaded dict) strictly, into
        `torch_dtype` (default: the checkpoint's dtype).
        `variant` in MAR_VARIANTS sets the transformer and head sizes; other config fields
        (img_size, class_num, num_sampling_steps, ...) may be given as keywords. `use_ema`
        (default True): the EMA weights (`model_ema`), as the official evaluation uses; False:
        the raw `model` weights."""
        if variant is not None:
            if variant not in MAR_VARIANTS:
                raise ValueError(f"variant must be one of {sorted(MAR_VARIANTS)}, got {variant!r}")
            config = {**MAR_VARIANTS[variant], **config}
        if not isinstance(checkpoint, dict):
            checkpoint = torch_checkpoint(checkpoint)  # weights only (the training args allowed): no code runs
        key = "model_ema" if use_ema else "model"
        if checkpoint.get(key) is not None:
            sd = checkpoint[key]
        elif "model" in checkpoint or "model_ema" in checkpoint:  # misc.save_model writes model_ema None without EMA
            raise ValueError(f"checkpoint has no {key!r} weights (entries {sorted(checkpoint)}, {key!r} "
                             f"{'None' if key in checkpoint else 'absent'}); pass use_ema={not use_ema}")
        else:
            sd = checkpoint  # a bare state dict
        model = cls(**config)
        dtype = torch_dtype or next((v.dtype for v in sd.values() if torch.is_tensor(v) and v.is_floating_point()), None)
        if dtype is not None:
            nn.Module.to(model, dtype)  # plain cast (ModelMixin.to warns about fp32-kept modules; MAR has none)
        model.load_official_state_dict(sd)
        return model.eval()

    def load_official_state_dict(self, state_dict: dict) -> None:
        """Strict load; any missing, unexpected or mis-shaped key is a ValueError naming them."""
        own = self.state_dict()
        missing = sorted(set(own) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(own))
        shapes = sorted(f"{k}: checkpoint {tuple(state_dict[k].shape)} vs model {tuple(own[k].shape)}"
                        for k in set(own) & set(state_dict) if tuple(own[k].shape) != tuple(state_dict[k].shape))
        if missing or unexpected or shapes:
            raise ValueError(
                "checkpoint does not match this MAR architecture (check variant / config): "
                f"missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''} ({len(missing)}), "
                f"unexpected keys {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)}), "
                f"shape mismatches {shapes[:8]}"
            )
        self.load_state_dict(state_dict, strict=True)
