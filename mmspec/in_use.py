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
    marked = False  # (set before the marks, so that a Ctrl-C landing anywhere after takes them back)
    try:
        with _LOCK:
            busy = [p for p in parts if id(p) in _IN_USE]
            if not busy:
                marked = True
                _IN_USE.update(keys)
        if busy:
            raise ValueError(
                f"{type(busy[0]).__name__} is decoding another request right now (another thread, or a callback "
                "calling back in): a target or drafter holds one request's caches at a time; build one target and "
                "drafter per thread (with a pipeline: one pipeline per thread, e.g. type(pipe)(**pipe.components), "
                "each with its own drafter object)")
        yield
    finally:
        if marked:
            with _LOCK:
                _IN_USE.difference_update(keys)


class PerThreadFlag:
    """A bool attribute with one value per thread (a data descriptor): a flag one call sets does
    not reach calls on other threads. Unset reads False; setting False drops the thread's entry."""

    def __set_name__(self, owner, name):
        self.key = f"_{name.lstrip('_')}_by_thread"

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        return obj.__dict__.get(self.key, {}).get(threading.get_ident(), False)

    def __set__(self, obj, value) -> None:
        flags = obj.__dict__.setdefault(self.key, {})
        if value:
            flags[threading.get_ident()] = True
        else:
            flags.pop(threading.get_ident(), None)
