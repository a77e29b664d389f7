"""User-facing pipelines (may import anything). Loaded lazily so `import mmspec` stays light."""

from __future__ import annotations

import importlib

_LAZY = {
    # VLMs (captioning / VQA)
    "SpeculativeVLMPipeline": "mmspec.pipelines.vlm",
    "VLMPipelineOutput": "mmspec.pipelines.vlm",
    "DrafterComponent": "mmspec.pipelines.vlm_drafter",
    "PlainDecoding": "mmspec.pipelines.vlm_drafter",
    # MAR (continuous tokens) with CSpD
    "SpeculativeMARPipeline": "mmspec.pipelines.mar_pipeline",
    "MARPipelineOutput": "mmspec.pipelines.mar_pipeline",
    "MARStats": "mmspec.pipelines.cspd",
    "sample_mar": "mmspec.pipelines.cspd",
    "sample_mar_self": "mmspec.pipelines.cspd_self",
    # class-conditional AR image generation (LlamaGen c2i)
    "SpeculativeARImagePipeline": "mmspec.pipelines.ar_image",
    "ARImagePipelineOutput": "mmspec.pipelines.ar_image",
    "ARImageStats": "mmspec.pipelines.ar_image",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mmspec.pipelines' has no attribute {name!r}")


__all__ = sorted(_LAZY)
