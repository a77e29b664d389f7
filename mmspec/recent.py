"""`Recent`: a list that keeps only its newest items, for per-step logs (the adaptive
controllers' chosen draft lengths) that a long-running server would otherwise grow without
bound. Reading it is reading a list."""

from __future__ import annotations


class Recent(list):
    """A list holding at most `2 * keep` items: past that, the oldest `keep` are dropped (in one
    chunk, so an append costs O(1) amortised)."""

    def __init__(self, keep: int = 100_000):
        super().__init__()
        self.keep = int(keep)

    def append(self, item) -> None:
        super().append(item)
        if len(self) > 2 * self.keep:
            del self[: self.keep]
