"""Drafters, importable as `mmspec.drafters` (one file per drafter family).

Every drafter implements `mmspec.Drafter`: `prefill`, `propose`, `commit`, `select_rows`.
"""

from __future__ import annotations

from .eagle_head import EagleHead, EagleHeadConfig, EagleHeadDrafter
from .model_drafter import ModelDrafter
from .vispec import ViSpecDrafter, ViSpecHead

__all__ = ["EagleHead", "EagleHeadConfig", "EagleHeadDrafter", "ModelDrafter", "ViSpecDrafter", "ViSpecHead"]
