"""Model adapters. These may import transformers; they are loaded lazily so that
`import mmspec` stays light."""

from __future__ import annotations

import importlib

_LAZY = {
    "HFTarget": "mmspec.models.hf_target",
    "HFSpec": "mmspec.models.hf_spec",
    "RaggedCache": "mmspec.models.hf_cache",
    "LlamaGenVQ": "mmspec.models.llamagen_tokenizer", "VQConfig": "mmspec.models.llamagen_tokenizer",
    "MARModel": "mmspec.models.mar", "load_kl16": "mmspec.models.kl16",
    "LlamaGenGPT": "mmspec.models.llamagen_gpt", "LlamaGenGPTConfig": "mmspec.models.llamagen_gpt",
    "generate_plain": "mmspec.models.llamagen_sample",
    "LlamaGenSpec": "mmspec.models.llamagen_spec", "LlamaGenTarget": "mmspec.models.llamagen_spec",
    "llamagen_target": "mmspec.models.llamagen_spec",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mmspec.models' has no attribute {name!r}")


__all__ = sorted(_LAZY)
