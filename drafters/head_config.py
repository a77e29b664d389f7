"""`EagleHeadConfig`: the shape of a feature draft head (EAGLE, ViSpec, FLASH) and the target
it was built for (drafters/eagle_head.py, vispec.py, flash.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EagleHeadConfig:
    """Shape of a draft head and what target it was built for. When a head is attached, its width,
    vocabulary and image token are checked against the target (`check_head_fits`);
    `target_model_type` is provenance only (a head of another model type with the same shapes
    runs, losslessly, and simply drafts worse)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    image_token_id: int | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    fc_bias: bool = True
    kind: str = "eagle"  # "eagle" | "vispec" | "flash"
    num_q: int = 2  # ViSpec: learned image queries (num_q - 1 image tokens + 1 global vector)
    target_model_type: str = ""
    slots: int = 1  # FLASH: tokens drafted per head forward (semi-autoregressive block)
    compress_len: int = 8  # FLASH: pooled tokens per image span

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must be divisible by num_attention_heads {self.num_attention_heads}, "
                f"and num_attention_heads by num_key_value_heads {self.num_key_value_heads}"
            )
        if self.kind not in ("eagle", "vispec", "flash"):
            raise ValueError(f"EagleHeadConfig.kind must be 'eagle', 'vispec' or 'flash', got {self.kind!r}")
        for name, low in (("num_q", 2), ("slots", 1), ("compress_len", 1)):  # num_q: image tokens + a global vector
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int) or getattr(self, name) < low:
                raise ValueError(f"EagleHeadConfig.{name} must be an int >= {low}, got {getattr(self, name)!r}")

    @classmethod
    def for_target(cls, model, **overrides) -> "EagleHeadConfig":
        """A head at the target's width (heads and MLP size from its text config; a config without
        `intermediate_size`, GPT-2's, gives `n_inner` or 4 x hidden). `overrides` replace fields,
        and a field the config lacks must be given there (ValueError naming it otherwise)."""
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        image_token = getattr(model.config, "image_token_id", getattr(model.config, "image_token_index", None))

        def read(name):
            if getattr(text, name, None) is None and name not in overrides:
                raise ValueError(f"EagleHeadConfig.for_target: the target's config ({type(text).__name__}) has no "
                                 f"{name!r}; pass {name}=... as an override")
            return overrides.get(name, getattr(text, name, None))

        width, heads = read("hidden_size"), read("num_attention_heads")
        mlp = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * int(width)
        values = dict(
            hidden_size=int(width), intermediate_size=int(mlp),
            num_attention_heads=heads, num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
            vocab_size=read("vocab_size"), image_token_id=None if image_token is None else int(image_token),
            rms_norm_eps=float(getattr(text, "rms_norm_eps", None) or 1e-6), target_model_type=str(model.config.model_type),
        )
        return cls(**{**values, **overrides})
