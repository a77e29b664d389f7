"""`Qwen2VLSpec`: the forward spec of Qwen2-VL / Qwen2.5-VL (M-RoPE positions).

Qwen2-VL rotates queries and keys with three position streams (temporal, height, width;
Wang et al. 2024, arXiv 2409.12191, section 2.1 "M-RoPE"). Text tokens carry the same
position in all three streams; an image's tokens carry their grid coordinates, so after an
image a row's positions run *behind* its token count by a per-row offset, `rope_deltas`.

- `begin` computes the prompt's `(3, B, L)` positions and the per-row deltas with the model's
  own `get_rope_index` (from `input_ids`, `mm_token_type_ids`, `image_grid_thw`,
  `video_grid_thw`, the attention mask; Qwen2.5-VL also `second_per_grid_ts`).
  `mm_token_type_ids` is derived from the image / video token ids when the caller leaves it
  out (what the processor returns).
- `positions(logical)` for every later forward (chains and tree nodes alike) is
  `logical + rope_deltas` in all three streams: a generated token at logical position p sits
  at M-RoPE position p + delta, exactly what the model's `generate` computes.
- `select_rows` keeps the deltas in step with the batch when rows finish.
- The image is encoded once, at prefill (the model's own forward merges it); its merged
  features (the images' entry of the base model's output; never a video's: a hook on the
  vision merger, which merges videos too, handed the heads a video's features) are what
  `FeatureRequest(image_features=True)` returns, flattened over the images in order
  ([num_image_tokens, H]); None for a batch without images.

Limits: only the model types in `MROPE_MODEL_TYPES`; other M-RoPE families (Qwen3-VL,
GLM-4V, ...) are refused by `HFTarget` rather than run with wrong positions.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from mmspec.models.hf_spec import HFSpec
from mmspec.ragged import Attention

MROPE_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


def model_type(model) -> str:
    return str(getattr(model.config, "model_type", ""))


class Qwen2VLSpec(HFSpec):
    """`HFSpec` with Qwen2-VL's M-RoPE positions and per-row `rope_deltas`."""

    compilable = False  # M-RoPE positions under torch.compile are not verified (static=True alone is fine)

    def __init__(self, model, source=None):
        source = source if source is not None else model
        if model_type(source) not in MROPE_MODEL_TYPES:
            raise ValueError(
                f"Qwen2VLSpec supports model types {MROPE_MODEL_TYPES}, got {model_type(source)!r} "
                f"({type(source).__name__})"
            )
        super().__init__(model, source=source)
        self.source = source
        base = source.model
        self._rope_index = base.get_rope_index
        self._rope_params = set(inspect.signature(base.get_rope_index).parameters)
        cfg = source.config
        self._image_token = getattr(cfg, "image_token_id", None)
        self._video_token = getattr(cfg, "video_token_id", None)
        self.rope_deltas: torch.Tensor | None = None  # [B, 1] long
        self._prompt_positions: torch.Tensor | None = None  # [3, B, L] long

    # ---- per request -----------------------------------------------------------------------
    def begin(self, input_ids, attention_mask, model_inputs: dict[str, Any]) -> None:
        super().begin(input_ids, attention_mask, model_inputs)
        image_grid = model_inputs.get("image_grid_thw")
        video_grid = model_inputs.get("video_grid_thw")
        for name, grid in (("image_grid_thw", image_grid), ("video_grid_thw", video_grid)):
            if grid is not None and (not isinstance(grid, torch.Tensor) or grid.is_floating_point()
                                     or grid.is_complex() or grid.dtype == torch.bool):
                got = getattr(grid, "dtype", type(grid).__name__)
                raise ValueError(f"{name} must be an integer tensor of (t, h, w) patch counts per image, as the "
                                 f"processor returns it; got {got}: pass a long tensor (e.g. {name}.long())")
        for pixels, name, grid in (("pixel_values", "image_grid_thw", image_grid),
                                   ("pixel_values_videos", "video_grid_thw", video_grid)):
            if model_inputs.get(pixels) is not None and grid is None:  # failed deep in transformers' vision utils
                raise ValueError(f"{pixels} without {name} (the patch grid of each one); pass the processor's "
                                 "outputs together")
        if image_grid is None and video_grid is None:
            # Text only: every stream is the logical position, no offset.
            logical = (attention_mask.long().cumsum(1) - 1).clamp_min(0)
            self._prompt_positions = logical.unsqueeze(0).expand(3, -1, -1)
            self.rope_deltas = torch.zeros(input_ids.shape[0], 1, dtype=torch.long, device=input_ids.device)
            return
        types = model_inputs.get("mm_token_type_ids")
        if types is None:
            types = self._token_types(input_ids)
        kwargs = {"mm_token_type_ids": types, "image_grid_thw": image_grid, "video_grid_thw": video_grid,
                  "attention_mask": attention_mask}
        for name in ("second_per_grid_ts",):
            if name in model_inputs and name in self._rope_params:
                kwargs[name] = model_inputs[name]
        try:
            positions, deltas = self._rope_index(input_ids, **kwargs)
        except (StopIteration, IndexError, RuntimeError) as e:
            raise ValueError(
                f"{type(self.source).__name__}: the image placeholders of input_ids do not match image_grid_thw / "
                f"video_grid_thw ({e!r}); build the inputs with the model's processor"
            ) from None
        self._prompt_positions = positions.to(input_ids.device)
        self.rope_deltas = deltas.to(device=input_ids.device, dtype=torch.long).view(-1, 1)

    def _token_types(self, input_ids: torch.Tensor) -> torch.Tensor:
        types = torch.zeros_like(input_ids, dtype=torch.int)
        if self._image_token is not None:
            types = types.masked_fill(input_ids == self._image_token, 1)
        if self._video_token is not None:
            types = types.masked_fill(input_ids == self._video_token, 2)
        return types

    def select_rows(self, rows: torch.Tensor) -> None:
        self.rope_deltas = self.rope_deltas.index_select(0, rows)

    # ---- positions ------------------------------------------------------------------------------
    def prefill_positions(self, attention: Attention) -> torch.Tensor:
        return self._prompt_positions

    def positions(self, logical: torch.Tensor) -> torch.Tensor:
        """logical [B, Q] -> (3, B, Q) = logical + rope_deltas in every stream."""
        return (logical + self.rope_deltas).unsqueeze(0).expand(3, -1, -1)

