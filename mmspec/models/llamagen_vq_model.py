"""`LlamaGenVQModel`: the LlamaGen VQ tokenizer (`mmspec.models.llamagen_tokenizer.LlamaGenVQ`)
as a diffusers component (`ModelMixin + ConfigMixin`), so a pipeline holding it round-trips
through `save_pretrained` / `from_pretrained`.

What: `LlamaGenVQ` is a plain `nn.Module` with its own folder format (config.json in
`VQConfig` fields + model.safetensors) and official-checkpoint loader. This class holds one
(`self.vq`) and registers the `VQConfig` fields as its diffusers config. Its `from_pretrained`
reads both a diffusers-saved folder and a `LlamaGenVQ` folder (the testbed's `vq/`), so a
pipeline folder may hold either. `codebook()`, `encode`, `decode` are forwarded.

Limits: the state-dict keys carry a `vq.` prefix in diffusers-saved folders; official
checkpoints load through `LlamaGenVQModel.from_vq(LlamaGenVQ.from_pretrained(file))`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config

from mmspec.models.llamagen_tokenizer import CONFIG_NAME, WEIGHTS_NAME, LlamaGenVQ, VQConfig
from mmspec.models.strict_load import strict_from_pretrained

_FIELDS = [f.name for f in dataclasses.fields(VQConfig)]


class LlamaGenVQModel(ModelMixin, ConfigMixin):
    """diffusers wrapper of `LlamaGenVQ` (see module docstring)."""

    config_name = "config.json"

    @register_to_config
    def __init__(self, codebook_size: int = 16384, codebook_embed_dim: int = 8, ch: int = 128,
                 ch_mult: tuple = (1, 1, 2, 2, 4), decoder_ch_mult: tuple | None = None, z_channels: int = 256,
                 num_res_blocks: int = 2, dropout: float = 0.0, commit_loss_beta: float = 0.25,
                 entropy_loss_ratio: float = 0.0, codebook_l2_norm: bool = True, codebook_show_usage: bool = True,
                 image_size: int = 256):
        super().__init__()
        values = dict(zip(_FIELDS, (codebook_size, codebook_embed_dim, ch, ch_mult, decoder_ch_mult, z_channels,
                                    num_res_blocks, dropout, commit_loss_beta, entropy_loss_ratio, codebook_l2_norm,
                                    codebook_show_usage, image_size)))
        self.vq = LlamaGenVQ(VQConfig(**values))

    @classmethod
    def from_vq(cls, vq: LlamaGenVQ) -> "LlamaGenVQModel":
        """Wrap an existing `LlamaGenVQ` (its weights are shared, not copied)."""
        if not isinstance(vq, LlamaGenVQ):
            raise TypeError(f"from_vq needs a LlamaGenVQ, got {type(vq).__name__}")
        model = cls(**vq.config.to_dict())
        model.vq = vq
        # nn.Module.to: diffusers' ModelMixin.to warns about fp32 modules on every dtype cast
        # (this model keeps none in float32).
        return torch.nn.Module.to(model, next(vq.parameters()).dtype)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        path = Path(pretrained_model_name_or_path)
        sub = kwargs.get("subfolder")
        folder = path / sub if sub else path
        if (folder / WEIGHTS_NAME).is_file() and (folder / CONFIG_NAME).is_file():
            config = json.loads((folder / CONFIG_NAME).read_text())
            if "_class_name" not in config:  # a LlamaGenVQ folder (config.json in VQConfig fields)
                # (`image_size` as for a diffusers folder, where it overrides the config; it was ignored here)
                model = cls.from_vq(LlamaGenVQ.from_pretrained(folder, image_size=kwargs.get("image_size")))
                dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
                return (torch.nn.Module.to(model, dtype) if dtype is not None else model).eval()
        return strict_from_pretrained(super().from_pretrained, cls.__name__, pretrained_model_name_or_path, *args, **kwargs)

    @property
    def vq_config(self) -> VQConfig:
        return self.vq.config

    @property
    def codebook_size(self) -> int:
        return self.vq.config.codebook_size

    @property
    def token_grid(self) -> int:
        return self.vq.config.token_grid

    def codebook(self) -> torch.Tensor:
        return self.vq.codebook()

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.vq.encode(pixels)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self.vq.decode(codes)

    def forward(self, pixels: torch.Tensor):
        return self.vq(pixels)
