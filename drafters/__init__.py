"""Drafters, importable as `mmspec.drafters` (one file per drafter family).

Every drafter implements `mmspec.Drafter`: `prefill`, `propose`, `commit`, `select_rows`.
"""

from __future__ import annotations

from .model_drafter import ModelDrafter

__all__ = ["ModelDrafter"]
