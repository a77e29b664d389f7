"""Drafters, importable as `mmspec.drafters` (one file per drafter family).

Every drafter implements `mmspec.Drafter`: `prefill`, `propose`, `commit`, `select_rows`.
"""

from __future__ import annotations

from .eagle_head import EagleHead, EagleHeadConfig, EagleHeadDrafter
from .flash import FlashDrafter, FlashHead
from .guided_drafter import GuidedModelDrafter
from .jacobi import JacobiDrafter
from .model_drafter import ModelDrafter
from .null_drafter import NullDrafter
from .vispec import ViSpecDrafter, ViSpecHead

__all__ = [
    "EagleHead", "EagleHeadConfig", "EagleHeadDrafter", "FlashDrafter", "FlashHead", "GuidedModelDrafter", "JacobiDrafter", "ModelDrafter",
    "NullDrafter", "ViSpecDrafter", "ViSpecHead",
]
