"""MAR's KL-16 VAE as a diffusers `AutoencoderKL`, with a converter from the official
`kl16.ckpt` layout.

Source: MAR (Li et al. 2024, arXiv 2406.11838), github.com/LTH14/mar `models/vae.py` (the latent-diffusion `AutoencoderKL`:
`Encoder` / `Decoder` with `down.{i}.block.{j}`, `down.{i}.attn.{j}`, `mid.block_1`, ...,
and `quant_conv` / `post_quant_conv`), loaded there from `{"model": state_dict}` with
`embed_dim=16, ch_mult=(1, 1, 2, 2, 4)`, ch=128, 2 res blocks per level, attention in the
encoder at resolution 16 only (plus both mid blocks), latents scaled by 0.2325.

`kl16_autoencoder_kwargs` gives the matching diffusers config; `convert_kl16_state_dict`
renames the keys (1x1 attention convs become linear layers); `load_kl16` does both and
loads strictly: a missing or unexpected key is a ValueError naming it. Keys under `loss.`
(the training discriminator / LPIPS of latent-diffusion checkpoints) are dropped on purpose.

Limits: the variational encoder only (`use_variational=True`, the official default).
"""

from __future__ import annotations

import re

import torch

from mmspec.models.strict_load import torch_checkpoint

KL16_SCALING_FACTOR = 0.2325  # MAR engine_mar.py: latents = posterior.sample() * 0.2325


def kl16_autoencoder_kwargs(ch: int = 128, ch_mult=(1, 1, 2, 2, 4), embed_dim: int = 16, num_res_blocks: int = 2,
                            resolution: int = 256, encoder_attn_resolutions=(16,), in_channels: int = 3) -> dict:
    """diffusers `AutoencoderKL(**kwargs)` matching an official KL VAE config."""
    levels = len(ch_mult)
    down = tuple("AttnDownEncoderBlock2D" if resolution // 2**i in encoder_attn_resolutions else "DownEncoderBlock2D"
                 for i in range(levels))
    return dict(in_channels=in_channels, out_channels=in_channels, down_block_types=down,
                up_block_types=("UpDecoderBlock2D",) * levels, block_out_channels=tuple(ch * m for m in ch_mult),
                layers_per_block=num_res_blocks, latent_channels=embed_dim, norm_num_groups=32, sample_size=resolution,
                scaling_factor=KL16_SCALING_FACTOR)


_RESNET = {"norm1": "norm1", "conv1": "conv1", "norm2": "norm2", "conv2": "conv2", "nin_shortcut": "conv_shortcut"}
_ATTN = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}


def _rename(key: str, levels: int) -> str | None:
    m = re.fullmatch(r"(encoder|decoder)\.(.*)", key)
    if m is None:
        return key if re.fullmatch(r"(post_)?quant_conv\.(weight|bias)", key) else None
    side, rest = m.groups()
    simple = {"conv_in": "conv_in", "conv_out": "conv_out", "norm_out": "conv_norm_out"}
    head, _, tail = rest.partition(".")
    if head in simple:
        return f"{side}.{simple[head]}.{tail}"
    if m := re.fullmatch(r"mid\.block_([12])\.(\w+)\.(weight|bias)", rest):
        return f"{side}.mid_block.resnets.{int(m[1]) - 1}.{_RESNET.get(m[2], m[2])}.{m[3]}"
    if m := re.fullmatch(r"mid\.attn_1\.(\w+)\.(weight|bias)", rest):
        return f"{side}.mid_block.attentions.0.{_ATTN[m[1]]}.{m[2]}" if m[1] in _ATTN else None
    if m := re.fullmatch(r"(down|up)\.(\d+)\.block\.(\d+)\.(\w+)\.(weight|bias)", rest):
        blk = int(m[2]) if m[1] == "down" else levels - 1 - int(m[2])
        return f"{side}.{m[1]}_blocks.{blk}.resnets.{m[3]}.{_RESNET.get(m[4], m[4])}.{m[5]}"
    if m := re.fullmatch(r"(down|up)\.(\d+)\.attn\.(\d+)\.(\w+)\.(weight|bias)", rest):
        blk = int(m[2]) if m[1] == "down" else levels - 1 - int(m[2])
        return f"{side}.{m[1]}_blocks.{blk}.attentions.{m[3]}.{_ATTN[m[4]]}.{m[5]}" if m[4] in _ATTN else None
    if m := re.fullmatch(r"down\.(\d+)\.downsample\.conv\.(weight|bias)", rest):
        return f"{side}.down_blocks.{m[1]}.downsamplers.0.conv.{m[2]}"
    if m := re.fullmatch(r"up\.(\d+)\.upsample\.conv\.(weight|bias)", rest):
        return f"{side}.up_blocks.{levels - 1 - int(m[1])}.upsamplers.0.conv.{m[2]}"
    return None


def convert_kl16_state_dict(state_dict: dict, levels: int) -> tuple[dict, list[str]]:
    """Official latent-diffusion VAE keys -> diffusers AutoencoderKL keys.
    -> (converted state dict, official keys that have no counterpart)."""
    out, unknown = {}, []
    for k, v in state_dict.items():
        if k.startswith("loss."):
            continue
        new = _rename(k, levels)
        if new is None:
            unknown.append(k)
            continue
        if ".attentions." in new and new.endswith(".weight") and v.dim() == 4:
            v = v[:, :, 0, 0]  # 1x1 conv -> linear
        out[new] = v
    return out, unknown


def load_kl16(checkpoint, torch_dtype: torch.dtype | None = None, **config):
    """`kl16.ckpt` (path, `{"model": sd}` or a bare state dict) -> diffusers AutoencoderKL,
    strictly (a path is read weights-only: a file holding other Python objects is refused, load it
    yourself if you trust it), in `torch_dtype` (default: the checkpoint's). `config` =
    `kl16_autoencoder_kwargs` arguments for non-default sizes."""
    from diffusers import AutoencoderKL

    if not isinstance(checkpoint, dict):
        checkpoint = torch_checkpoint(checkpoint)  # weights only: no code from the file runs
    sd = checkpoint.get("model", checkpoint) if isinstance(checkpoint.get("model", None), dict) else checkpoint
    kwargs = kl16_autoencoder_kwargs(**config)
    vae = AutoencoderKL(**kwargs)
    dtype = torch_dtype or next((v.dtype for v in sd.values() if torch.is_tensor(v) and v.is_floating_point()), None)
    if dtype is not None:
        torch.nn.Module.to(vae, dtype)
    converted, unknown = convert_kl16_state_dict(sd, len(kwargs["block_out_channels"]))
    own = vae.state_dict()
    missing = sorted(set(own) - set(converted))
    unexpected = sorted(set(converted) - set(own)) + unknown
    shapes = [f"{k}: {tuple(converted[k].shape)} vs {tuple(own[k].shape)}" for k in sorted(set(own) & set(converted))
              if converted[k].shape != own[k].shape]
    if missing or unexpected or shapes:
        raise ValueError(f"checkpoint does not match the KL VAE config {config or '(KL-16 defaults)'}: missing keys "
                         f"{missing[:8]} ({len(missing)}), unexpected keys {unexpected[:8]} ({len(unexpected)}), "
                         f"shape mismatches {shapes[:8]}")
    vae.load_state_dict(converted, strict=True)
    return vae.eval()
