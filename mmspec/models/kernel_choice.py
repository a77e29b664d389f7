"""Choose the linear kernels by measuring them on this machine, not by assuming.

On some CPUs oneDNN's prepacked linear (mmspec/models/prepack.py) is much faster than stock
`F.linear` at the few-row shapes of decoding and verification; on others it is slower; and on
one CPU the answer can depend on the number of rows. Measured on our 2-core VM, the 50M bench
target's linear layers: prepacked 2-7% *slower* at 1 row (plain decoding, drafting at batch 1),
15-25% faster at 2-8 rows (a batch-1 verify, small batches), 3% faster at 32 rows. One choice
per model loses at one of these shapes, so the choice is made per row count.

For `prepack="auto"` we time both kernels on the model's own linear layers, run in sequence as
a forward runs them (so weights come from memory, not from a cache kept warm by repeating one
layer), at a few row counts (`ROWS`), a few hundred milliseconds at most, and keep per row
count the faster one (prepacked only when at least 5% faster: it costs memory). The result is
a `KernelPolicy` that each packed linear consults with its input's row count (the nearest
measured row count, in log scale, decides); it is cached per model and layer-shape set.
"""

from __future__ import annotations

import math
import time
import weakref
from collections import Counter

import torch
import torch.nn.functional as F

# Decode / draft step at batch 1, a short verify, a batch-1 verify or small batch, a verify of
# K = 1 at batch 8 or plain decoding at batch 16, a batched verify. 16 is measured, not inferred
# from its neighbours: on a 2-core Xeon VM (session 41) stock `F.linear` jumped from 17 ms a
# pass over the bench target's layers at 12 rows to 24 ms at 16, where the packed kernel took
# 19 ms; without 16 in the list the tie between 8 and 32 gave 16 rows the stock kernel, and a
# K = 1 verify at batch 8 cost as much as one at batch 16.
ROWS = (1, 2, 8, 16, 32)
MARGIN = 0.95  # prepacked must be at least 5% faster to be chosen (it costs memory)
ROUNDS = 5  # alternating passes per kernel and row count (fewer when the budget runs out)
PASS_BYTES = 64 << 20  # a timed pass reads at most this much weight (beyond any CPU cache)
_CACHE: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


class KernelPolicy:
    """Which kernel a linear layer uses for an input of M rows: the decision measured at the
    row count nearest to M in log scale (ties go to the smaller one)."""

    __slots__ = ("rows", "packed", "_memo")

    def __init__(self, rows: tuple[int, ...], packed: tuple[bool, ...]):
        if len(rows) != len(packed) or not rows or list(rows) != sorted(set(rows)) or rows[0] < 1:
            raise ValueError(f"rows must be increasing ints >= 1 with one decision each, got {rows}, {packed}")
        self.rows, self.packed = tuple(rows), tuple(bool(p) for p in packed)
        self._memo: dict[int, bool] = {}

    def use_packed(self, m: int) -> bool:
        hit = self._memo.get(m)
        if hit is None:
            if m >= self.rows[-1]:  # nearest in log scale: the largest measured (no memo entry per prompt shape)
                return self.packed[-1]
            lm = math.log(max(m, 1))
            best = min(range(len(self.rows)), key=lambda i: (abs(lm - math.log(self.rows[i])), i))
            hit = self._memo[m] = self.packed[best]
        return hit

    @property
    def uniform(self) -> bool | None:
        """True / False when every row count takes the same kernel, else None."""
        return self.packed[0] if len(set(self.packed)) == 1 else None

    def describe(self) -> str:
        if self.uniform is not None:
            return "prepacked" if self.uniform else "stock"
        parts = [f"{'prepacked' if p else 'stock'} at {r}" for r, p in zip(self.rows, self.packed)]
        return "mixed by rows (" + ", ".join(parts) + ")"

    def __eq__(self, other) -> bool:
        return isinstance(other, KernelPolicy) and (self.rows, self.packed) == (other.rows, other.packed)

    def __repr__(self) -> str:
        return f"KernelPolicy({self.rows}, {self.packed})"


def _time(fn, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


@torch.no_grad()
def measure(model: torch.nn.Module, rows: tuple[int, ...] = ROWS, budget_s: float = 0.4) -> dict:
    """Seconds per pass over the model's linear layers on each kernel at each row count, and
    the resulting `KernelPolicy` (`"prepack"`: True when any row count takes the packed kernel).

    A pass runs the model's own `nn.Linear` layers one after the other, in module order, as a
    forward does, so each weight is read from memory as it would be in decoding (a loop over
    one layer would keep its weight in cache and flatter whichever kernel is cache-bound).
    For large models the pass covers the first layers up to `PASS_BYTES` of weights, which is
    far beyond any CPU cache. The kernels alternate pass by pass and each keeps its fastest
    pass: interference (another process, a page fault) only ever adds time."""
    from mmspec.models.prepack import PackedLinear, packable

    linears = [m for m in model.modules() if packable(m)]  # the layers a view would pack (float32 only)
    shapes = Counter((m.in_features, m.out_features, m.bias is not None) for m in linears)
    key = (tuple(sorted(shapes.items())), tuple(rows))
    cached = _CACHE.get(model)
    if cached is not None and cached["key"] == key:
        return cached["result"]
    chosen, size = [], 0
    for m in linears:
        if size >= PASS_BYTES:
            break
        chosen.append(m)
        size += m.weight.numel() * m.weight.element_size()
    packed_layers = [PackedLinear(m) for m in chosen]
    dtype = torch.float32  # every packable weight's: the inputs of each layer match it
    per_rows = {}
    start = time.perf_counter()
    noise = torch.Generator().manual_seed(0)  # its own: the user's global random stream is not drawn from
    for j, M in enumerate(rows):
        inputs = {n: torch.randn(M, n, dtype=dtype, generator=noise) for n in {m.in_features for m in chosen}}

        def stock_call():
            for m in chosen:
                F.linear(inputs[m.in_features], m.weight, m.bias)

        def packed_call():  # (forward, not __call__: the model's hooks must not see the random inputs)
            for m in packed_layers:
                m.forward(inputs[m.in_features])

        stock_call(), packed_call()  # warm-up (allocator, first-call dispatch)
        s_t = p_t = float("inf")
        for r in range(ROUNDS):
            s_t = min(s_t, _time(stock_call, 1))
            p_t = min(p_t, _time(packed_call, 1))
            if r >= 1 and time.perf_counter() - start > budget_s * (j + 1) / len(rows):
                break  # at least two passes each; the budget is shared by the row counts
        per_rows[M] = (s_t, p_t)
    policy = KernelPolicy(tuple(rows), tuple(p < MARGIN * s for s, p in per_rows.values()))
    result = {
        "stock_s": sum(s for s, _ in per_rows.values()), "prepacked_s": sum(p for _, p in per_rows.values()),
        "rows": {M: {"stock_s": s, "prepacked_s": p} for M, (s, p) in per_rows.items()},
        "policy": policy, "prepack": any(policy.packed), "layers_timed": len(chosen), "layers": len(linears),
    }
    _CACHE[model] = {"key": key, "result": result}
    return result
