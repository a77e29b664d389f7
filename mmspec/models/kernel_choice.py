"""Choose the linear kernels by measuring them on this machine, not by assuming.

On some CPUs oneDNN's prepacked linear (mmspec/models/prepack.py) is much faster than stock
`F.linear` at the few-row shapes of decoding and verification; on others it is slower. For
`prepack="auto"` we time both on the model's own linear shapes (each distinct weight shape
once, weighted by how many layers have it) at the row counts that matter (1 for plain
decoding and drafting, a verify's K+1 and a batch's B*(K+1)), a few hundred milliseconds at
most, and keep the faster one. The result is cached per model and shape set.
"""

from __future__ import annotations

import time
import weakref
from collections import Counter

import torch
import torch.nn.functional as F

ROWS = (1, 5, 32)  # decode / draft step, a batch-1 verify, a batched verify
MARGIN = 0.95  # prepacked must be at least 5% faster to be chosen (it costs memory)
_CACHE: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def _time(fn, reps: int) -> float:
    fn()  # warm-up (and the packed weight's first reorder)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


@torch.no_grad()
def measure(model: torch.nn.Module, rows: tuple[int, ...] = ROWS, budget_s: float = 0.25) -> dict:
    """Seconds per forward of the model's linear layers on each kernel, and the choice."""
    from mmspec.models.prepack import PackedLinear

    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    shapes = Counter((m.in_features, m.out_features, m.bias is not None) for m in linears)
    key = tuple(sorted(shapes.items()))
    cached = _CACHE.get(model)
    if cached is not None and cached["key"] == key:
        return cached["result"]
    examples = {}
    for m in linears:
        examples.setdefault((m.in_features, m.out_features, m.bias is not None), m)
    stock = packed = 0.0
    start = time.perf_counter()
    for shape, count in sorted(shapes.items(), key=lambda kv: -kv[1] * kv[0][0] * kv[0][1]):
        lin = examples[shape]
        packed_lin = PackedLinear(lin)
        for M in rows:
            x = torch.randn(M, lin.in_features, dtype=lin.weight.dtype)
            def stock_call():
                return F.linear(x, lin.weight, lin.bias)

            def packed_call():
                return packed_lin(x)

            # Alternate the kernels so a drift of the machine hits both alike.
            s_t = p_t = 0.0
            for _ in range(2):
                s_t += _time(stock_call, 2)
                p_t += _time(packed_call, 2)
            stock += count * s_t
            packed += count * p_t
        if time.perf_counter() - start > budget_s:
            break  # the largest shapes (most of the time) are measured first
    result = {"stock_s": stock, "prepacked_s": packed, "prepack": packed < MARGIN * stock}
    _CACHE[model] = {"key": key, "result": result}
    return result
