"""The testbed: a procedural world and the small models the project trains on it.

What: ``World`` (scenes with images, class labels, captions, Q/A), ``Judge`` (a CNN that
scores generated images), and training/eval commands (``cli.py``). Why: no model hub is
reachable, so mmspec ships its own reproducible toy models (assets/testbed/README.md).

``World`` and ``Judge`` are exported lazily so that ``import mmspec.testbed`` pulls in
neither PIL nor transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "World": "mmspec.testbed.world",
    "WorldConfig": "mmspec.testbed.world",
    "Scene": "mmspec.testbed.world",
    "Judge": "mmspec.testbed.judge_model",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mmspec.testbed' has no attribute {name!r}")
