"""`exclusive(target, drafter)`: one request at a time per target and drafter object.

A target or drafter holds one request's state (KV caches, draft windows, CFG halves), so two
threads decoding through the same object at once overwrote each other's caches: most calls
failed with shape errors from deep in the forward, and some returned wrong tokens silently.
The second call is now refused by name; build one target and drafter per thread (a bare
transformers model passed to `speculative_generate` is wrapped per call and may be shared).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

_LOCK = threading.Lock()
_IN_USE: set[int] = set()  # id() of the objects a running request decodes through (alive while it runs)


def _parts(target, drafter) -> list:
    """The target, the targets it wraps (`GuidedTarget.target`, ...) and the drafter."""
    parts, obj = [drafter], target
    while obj is not None and len(parts) < 8 and all(obj is not p for p in parts):
        parts.append(obj)
        inner = getattr(obj, "target", None)
        obj = inner if callable(getattr(inner, "verify", None)) else None
    return parts


@contextmanager
def exclusive(target, drafter):
    parts = _parts(target, drafter)
    keys = {id(p) for p in parts}
    with _LOCK:
        busy = [p for p in parts if id(p) in _IN_USE]
        if not busy:
            _IN_USE.update(keys)
    if busy:
        raise ValueError(
            f"{type(busy[0]).__name__} is decoding another request right now (another thread, or a callback "
            "calling back in): a target or drafter holds one request's caches at a time; build one target and "
            "drafter per thread (with a pipeline: one pipeline per thread, e.g. type(pipe)(**pipe.components), "
            "each with its own drafter object)")
    try:
        yield
    finally:
        with _LOCK:
            _IN_USE.difference_update(keys)
