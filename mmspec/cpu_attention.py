"""Choose, on CPU, between torch's fused attention and plain matmul attention for step forwards,
by timing both on the forwards' own tensors, not by assuming.

Why: a verify forward attends a few queries per row (K + 1) over the cache, with a 4-D additive
mask (ragged rows, trees). On CPU, `scaled_dot_product_attention` sends such inputs to its
flash kernel, which parallelises over (batch, head) blocks and pays a fixed cost per block;
for a handful of queries the plain form, scores = q k^T * scale + mask, softmax, times v, is
two batched GEMMs and one softmax. Measured on our 2-core Xeon VM (session 51; 8 heads of 64,
34-90 keys, float32): at one row the fused kernel is faster (1.2-2.7x); at 4-16 rows with 2-9
queries the plain form takes 0.4-0.8x its time, in the bench target's real forwards 0.72x at
8 rows with 3 queries (321 vs 449 us per layer). One fixed choice loses at some of these
shapes, and another CPU may rank them differently, so the choice is made per shape class
(rows, queries, keys, each rounded up to a power of two; heads, kv heads, head dim, dtype,
threads) from paired timings of both forms on the first `SAMPLES` calls of that class in
real forwards, alternating which runs first. During those calls the fused kernel's output is
returned (what torch alone would give); after them the class keeps the plain form only when
the median of its paired time ratios is at most `MARGIN`. Each class is decided once per
process; a class costs `SAMPLES` extra attention calls (a few milliseconds in all).

What takes part: float32 / bfloat16 / float16 CPU forwards without autograd, with a
floating-point 4-D additive mask [B, 1, Q, S] (one-token forwards with no mask stay on torch's
path: nothing to gain there). float64 (the exactness tests) keeps torch's path unless a test
forces a form with `forced(...)`. The plain form computes the softmax in float32 for half
precision inputs, as transformers' eager attention does; grouped-query heads share their key
and value heads without copies (query head h reads kv head h // group, as `repeat_kv`). The
two forms agree to rounding; which one ran is in `choices()` for benchmarks to report.
`HFTarget(..., attention="torch")` / `ModelDrafter(..., attention="torch")` never use it.
transformers models reach it through mmspec/models/hf_attention.py, mmspec's LlamaGen GPT
through `LlamaGenSpec` (an `attend` function handed to its layers).
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

FORMS = ("sdpa", "matmul")
MARGIN = 0.9  # the plain form must take at most 0.9x the fused kernel's time (median of pairs)
SAMPLES = 6  # paired timings per shape class before it is decided
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DECIDED: dict[tuple, str] = {}
_RATIOS: dict[tuple, list[float]] = {}
_FORCED: list[str | None] = [None]


def _up(n: int) -> int:
    """n rounded up to a power of two (the shape classes' boundaries)."""
    return 1 << max(n - 1, 0).bit_length()


def shape_class(q: torch.Tensor, k: torch.Tensor) -> tuple:
    B, H, Q, D = q.shape
    return (_up(B), _up(Q), _up(k.shape[2]), H, k.shape[1], D, q.dtype, torch.get_num_threads())


def matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v. q [B, H, Q, D]; k, v [B, Hk, S, D] with H a multiple of
    Hk; mask additive [B or 1, 1, Q, S] or None. Returns [B, H, Q, D]."""
    B, H, Q, D = q.shape
    Hk = k.shape[1]
    if H % Hk:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({Hk})")
    g = H // Hk
    scale = D ** -0.5 if scale is None else scale
    if g > 1:  # query head h reads kv head h // g: split the head axis, broadcast k and v
        q = q.reshape(B, Hk, g, Q, D)
        k, v = k.unsqueeze(2), v.unsqueeze(2)
        mask = None if mask is None else mask.unsqueeze(2)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    half = scores.dtype in (torch.float16, torch.bfloat16)
    if half:  # mask and softmax in float32: a score plus float16's most negative value overflows
        scores = scores.float()
    if mask is not None:
        scores.add_(mask)
    probs = scores.softmax(-1).to(q.dtype) if half else scores.softmax(-1)
    out = torch.matmul(probs, v)
    return out.reshape(B, H, Q, v.shape[-1]) if g > 1 else out


def takes_part(x: torch.Tensor) -> bool:
    """Whether forwards on tensors like `x` (device, dtype, autograd) may take part; a cheap
    check for callers that would otherwise build a mask for nothing."""
    return x.device.type == "cpu" and not x.requires_grad and (_FORCED[0] is not None or x.dtype in _DTYPES)


def eligible(q: torch.Tensor, mask) -> bool:
    """Inputs the choice takes part in (see the module docstring)."""
    return (isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.dtype == q.dtype and mask.shape[1] == 1
            and takes_part(q))


def attend(q, k, v, mask, scale, torch_path) -> torch.Tensor:
    """Attention of `q` over `k`, `v` with the additive `mask`, by the form chosen for this shape
    class. `torch_path()` returns torch's own result for the same inputs, [B, H, Q, D] (any
    strides). Call only with `eligible` inputs."""
    forced = _FORCED[0]
    if forced is not None:
        return torch_path() if forced == "sdpa" else matmul_attention(q, k, v, mask, scale)
    key = shape_class(q, k)
    form = _DECIDED.get(key)
    if form == "sdpa":
        return torch_path()
    if form == "matmul":
        return matmul_attention(q, k, v, mask, scale)
    ratios = _RATIOS.setdefault(key, [])
    if len(ratios) % 2 == 0:  # alternate which form runs first (the second may find warm caches)
        t0 = time.perf_counter()
        out = torch_path()
        t1 = time.perf_counter()
        matmul_attention(q, k, v, mask, scale)
        t2 = time.perf_counter()
        fused, plain = t1 - t0, t2 - t1
    else:
        t0 = time.perf_counter()
        matmul_attention(q, k, v, mask, scale)
        t1 = time.perf_counter()
        out = torch_path()
        t2 = time.perf_counter()
        fused, plain = t2 - t1, t1 - t0
    ratios.append(plain / max(fused, 1e-9))
    if len(ratios) >= SAMPLES:
        _DECIDED[key] = "matmul" if statistics.median(ratios) <= MARGIN else "sdpa"
    return out


def choices() -> list[dict]:
    """The decided shape classes: rows, queries, keys (upper bounds), heads, dtype, the form
    kept and the median plain/fused time ratio it was decided on."""
    out = []
    for key, form in sorted(_DECIDED.items(), key=lambda kv: (str(kv[0][6]), kv[0][:6])):
        B, Q, S, H, Hk, D, dtype, threads = key
        out.append({"rows": B, "queries": Q, "keys": S, "heads": H, "kv_heads": Hk, "head_dim": D,
                    "dtype": str(dtype).removeprefix("torch."), "threads": threads, "form": form,
                    "matmul_over_sdpa": round(statistics.median(_RATIOS[key]), 3)})
    return out


def describe() -> str:
    """One line for reports: how many shape classes keep each form."""
    made = list(_DECIDED.values())
    if _FORCED[0] is not None:
        return f"forced to {_FORCED[0]}"
    if not made:
        return "torch's (no CPU shape class decided yet)"
    plain = [c for c in choices() if c["form"] == "matmul"]
    pairs = sorted({(c["rows"], c["queries"]) for c in plain})
    where = ", ".join(f"{b}x{q}" for b, q in pairs[:8]) + (" ..." if len(pairs) > 8 else "")
    return f"matmul in {len(plain)} of {len(made)} shape classes" + (f" (rows x queries <= {where})" if plain else "")


def reset() -> None:
    """Forget every decision (benchmarks that compare both forms; tests)."""
    _DECIDED.clear()
    _RATIOS.clear()


@contextlib.contextmanager
def forced(form: str | None):
    """Within the block every eligible call (float64 too) takes `form` ("sdpa" or "matmul");
    None restores the measured choice. For tests and benchmarks."""
    if form is not None and form not in FORMS:
        raise ValueError(f"form must be one of {FORMS} or None, got {form!r}")
    before = _FORCED[0]
    _FORCED[0] = form
    try:
        yield
    finally:
        _FORCED[0] = before
