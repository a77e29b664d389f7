"""User-facing pipelines, importable as `mmspec.pipelines` (they may import diffusers).

`SpeculativeARImagePipeline`: class-conditional AR image generation (LlamaGen c2i) with
speculative decoding, a diffusers `DiffusionPipeline`.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "SpeculativeARImagePipeline": "mmspec.pipelines.ar_image",
    "ARImagePipelineOutput": "mmspec.pipelines.ar_image",
    "ARImageStats": "mmspec.pipelines.ar_image",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mmspec.pipelines' has no attribute {name!r}")


__all__ = sorted(_LAZY)
