"""`version_of`: a tensor's in-place version counter, for cache keys that must see in-place edits."""

from __future__ import annotations

import torch


def version_of(t: torch.Tensor) -> int | None:
    """`t._version`, or None for an inference tensor (made under `torch.inference_mode()`), which
    tracks no version: in-place edits of it cannot be seen, so a cache must not key on it."""
    return None if t.is_inference() else t._version
