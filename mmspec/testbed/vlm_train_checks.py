"""What `VLMTrainConfig` (mmspec/testbed/vlm_train.py) refuses, by name, before any stage runs:
counts, the image / patch geometry, fractions, learning rates, model shapes, schedules, the
device. A bad value found only when its stage starts would cost the minutes of the stages before."""

from __future__ import annotations

import math

from mmspec.devices import check_device


def check_config(c) -> None:
    """Raise a ValueError naming the first field of `c` (a VLMTrainConfig) that training cannot use."""
    from mmspec.pipelines.train_config import LR_SCHEDULES  # imported here, as `mmspec.pipelines` is set up by mmspec
    from mmspec.testbed.language import CAPTION_ORDERS

    for name in ("n_train", "n_val", "tower_steps", "tower_batch", "lm_steps", "lm_batch", "lm_pack",
                 "drafter_images", "drafter_steps", "drafter_batch", "accept_scenes", "max_new_tokens", "threads",
                 "answer_tokens"):
        if getattr(c, name) < 1:
            raise ValueError(f"VLMTrainConfig.{name} must be >= 1, got {getattr(c, name)}")
    if c.num_visual_tokens < 32:
        raise ValueError(f"{c.num_visual_tokens} visual tokens per image; the testbed VLM needs >= 32 "
                         "(lower patch_size or raise image_size)")
    if c.image_size % c.patch_size:
        raise ValueError(f"image_size={c.image_size} is not a multiple of patch_size={c.patch_size}")
    for name in ("lm_tower_layers", "tune_tower_layers"):
        if not 0 <= getattr(c, name) <= c.tower_layers:
            raise ValueError(f"{name}={getattr(c, name)}: must be in [0, tower_layers={c.tower_layers}]")
    if not 0 <= c.lm_exists_fraction <= 1:
        raise ValueError(f"lm_exists_fraction={c.lm_exists_fraction} must be in [0, 1]")
    if c.tune_steps < 0 or c.tune_lr <= 0 or not 0 <= c.tune_exists_fraction <= 1:
        raise ValueError(f"tune_steps={c.tune_steps} must be >= 0, tune_lr={c.tune_lr} > 0 and "
                         f"tune_exists_fraction={c.tune_exists_fraction} in [0, 1]")
    if c.lm_shape_weight <= 0 or c.lm_tower_lr_scale < 0 or c.tower_object_weight < 0:
        raise ValueError(f"lm_shape_weight={c.lm_shape_weight} must be > 0, lm_tower_lr_scale="
                         f"{c.lm_tower_lr_scale} and tower_object_weight={c.tower_object_weight} >= 0")
    if c.caption_order not in CAPTION_ORDERS:
        raise ValueError(f"caption_order={c.caption_order!r}: choose from {CAPTION_ORDERS}")
    if c.vision_feature_select_strategy not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy={c.vision_feature_select_strategy!r}: "
                         "choose 'default' (CLS dropped) or 'full' (CLS kept)")
    if c.drafter_lr_schedule not in LR_SCHEDULES or not 0 <= c.drafter_warmup < c.drafter_steps:
        raise ValueError(f"drafter_lr_schedule={c.drafter_lr_schedule!r} must be one of {LR_SCHEDULES} and "
                         f"drafter_warmup={c.drafter_warmup} in [0, drafter_steps={c.drafter_steps}) (fewer steps: "
                         "pass a smaller --drafter-warmup)")
    # Checked here too (session 55): these trained the data and tower stages first and then failed
    # building a model, or trained with a negative learning rate.
    for name in ("tower_lr", "lm_lr", "drafter_lr"):
        v = getattr(c, name)
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"VLMTrainConfig.{name} must be a finite number > 0, got {v}")
    for name in ("tower_dim", "tower_layers", "tower_heads", "lm_dim", "lm_layers", "lm_heads", "lm_ffn", "num_draft_tokens",
                 "flash_compress_len"):
        if getattr(c, name) < 1:
            raise ValueError(f"VLMTrainConfig.{name} must be >= 1, got {getattr(c, name)}")
    for dim, heads in (("tower_dim", "tower_heads"), ("lm_dim", "lm_heads")):
        if getattr(c, dim) % getattr(c, heads):
            raise ValueError(f"VLMTrainConfig.{dim}={getattr(c, dim)} is not divisible by {heads}={getattr(c, heads)}")
    if not 0 <= c.caption_fraction <= 1 or c.warmup < 0:
        raise ValueError(f"VLMTrainConfig.caption_fraction={c.caption_fraction} must be in [0, 1] and warmup={c.warmup} >= 0")
    check_device(c.device)  # before the data stage, not after it
