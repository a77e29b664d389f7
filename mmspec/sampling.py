"""Turning logits into the distributions speculative decoding compares.

Target and drafter logits go through the same processing (temperature, top-k, top-p), so
`p` and `q` (docs/algorithms.md) are always the *processed* distributions; this is what makes
exact speculative sampling distributed like plain sampling with the same settings. The
math runs in float32 or wider (float64 models stay float64).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch


def plain_number(x):
    """A NumPy scalar (`np.float32(0.2)`, `np.int64(3)`) as the Python number it holds, anything else
    as it is. Options are checked as Python ints / floats, and a NumPy scalar was refused as out of
    range although it lay inside it; bools, tensors and strings stay for the caller to refuse."""
    if isinstance(x, (bool, int, float)) or not isinstance(x, numbers.Real) or type(x).__module__ != "numpy":
        return x
    return int(x) if isinstance(x, numbers.Integral) else float(x)


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are drawn. `temperature == 0` means greedy."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_k", "top_p"):
            object.__setattr__(self, name, plain_number(getattr(self, name)))
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if 0 < t < 1e-30:  # logits / t overflowed float32 into all-NaN rows, reported as a broken model
            raise ValueError(f"temperature={t!r} is too small to divide logits by in float32; use temperature=0 "
                             "(greedy), which is what it approaches")
        if t > 1e30:  # float32 made it inf: every logit 0 (top-k / top-p not honoured), masked ones NaN
            raise ValueError(f"temperature={t!r} is too large to divide logits by in float32; use at most 1e30 "
                             "(near-uniform sampling over the tokens top_k / top_p keep)")
        k = self.top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"top_k must be None or an int >= 1, got {k!r}")
        p = self.top_p
        if p is not None and (
            isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p) or not 0.0 < p <= 1.0
        ):
            raise ValueError(f"top_p must be None or a number in (0, 1], got {p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def process_logits(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] after temperature, top-k and top-p.

    With `temperature == 0` the result is the one-hot of the argmax (ties to the lowest id,
    like `torch.argmax`), which keeps greedy decoding a special case of the same code."""
    x = logits.to(_math_dtype(logits.dtype))
    if config.greedy:
        return torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).to(x.dtype)
    if config.temperature != 1:  # x / 1 == x: one operation fewer on the common path
        x = x / config.temperature
    if config.top_k is not None and config.top_k < x.shape[-1]:
        # Like transformers' TopKLogitsWarper: every token tied with the k-th largest stays.
        kth = torch.topk(x, config.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if config.top_p is not None and config.top_p < 1.0:
        # The same operations as transformers' TopPLogitsWarper (min_tokens_to_keep=1), so the
        # kept set is identical, ties at the nucleus boundary and float rounding included:
        # ascending sort (the same call, so ties are ordered the same way: on CPU the higher
        # ids of a tie sort later and are kept), drop the low tail whose cumulative mass is
        # <= 1 - top_p, always keep the largest.
        sorted_x, order = torch.sort(x, descending=False)
        drop_sorted = sorted_x.softmax(-1).cumsum(-1) <= (1 - config.top_p)
        drop_sorted[..., -1:] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x.softmax(-1)


def probs_finite(probs: torch.Tensor) -> torch.Tensor:
    """Whether a tensor of probabilities (entries in [0, 1]) holds no NaN or inf: a 0-dim bool
    tensor, no host sync. Their sum is then at most `numel` and finite, and a NaN or inf
    entry makes it NaN or inf: one reduction and two scalar operations instead of a bool
    tensor as large as `probs` and its reduction (~3x less time on a CPU at [1, 17, 512],
    ~7x at [8, 17, 512]). (Entries beyond 1 whose sum overflows would read as non-finite: not
    probabilities, refused all the same.)"""
    total = probs.sum(dtype=torch.float64 if probs.dtype == torch.float64 else torch.float32)
    return total * 0 == 0  # inf * 0 and NaN * 0 are NaN


def check_finite_probs(probs: torch.Tensor, what: str) -> torch.Tensor:
    """Raise a ValueError naming `what` (e.g. "drafter logits") when `probs` holds NaN or
    inf; returns `probs` unchanged otherwise. One device sync: call it once per step."""
    if not bool(torch.isfinite(probs).all()):
        kind = "NaN" if bool(torch.isnan(probs).any()) else "inf"
        raise ValueError(
            f"{what} contain {kind} values; mmspec will not sample from them. Check the model that produced "
            "them (weights, dtype overflow, e.g. float16 on CPU) and the sampling settings"
        )
    return probs


def check_generator(generator) -> None:
    """`generator` must be None or one `torch.Generator` (on any device: draws happen on its
    device, see `draw`). A list of generators (diffusers' one-per-image form) is refused by name:
    every row's draws come from the one generator in turn."""
    if generator is None or isinstance(generator, torch.Generator):
        return
    if isinstance(generator, (list, tuple)):
        raise ValueError(
            f"generator: a list of {len(generator)} generators (one per image) is not supported; pass one "
            "torch.Generator (the batch draws from it in turn, so a seed still reproduces the whole batch)")
    raise TypeError(f"generator must be None or a torch.Generator, got {type(generator).__name__}")


def draw(fn, *shape, generator: torch.Generator | None = None, dtype=None, device=None) -> torch.Tensor:
    """``fn(*args)`` (``torch.rand`` / ``randn`` / ``randint``) drawn on the generator's device and moved to
    ``device``: a CPU generator (diffusers' convention for reproducible seeds) drives a CUDA model,
    and the same seed gives the same numbers on either device."""
    where = generator.device if generator is not None else device
    out = fn(*shape, generator=generator, dtype=dtype, device=where)
    if device is None or out.device == (device if isinstance(device, torch.device) else torch.device(device)):
        return out  # (a skipped `.to` is one call fewer: it runs a few times every step)
    return out.to(device)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """probs [B, V] (non-negative weights, not necessarily normalised) -> tokens [B].

    Inverse-CDF sampling: one uniform per row, scaled by the row's total mass, located in the
    running sum with `searchsorted`. Exactly the law of `torch.multinomial(probs, 1)` (a token
    of zero weight owns an empty interval and is never drawn) at a fraction of its cost on CPU
    (measured ~10x at [16, 512] and [128, 512]). The uniform is kept strictly below the
    total so rounding can never run past the last token of positive weight.

    Rows that are not a distribution (NaN / inf / negative, or no mass) are sampled uniformly
    instead of aborting mid-step; the loop checks every distribution inside the step's one
    host sync and raises a ValueError naming the culprit, so nothing sampled from such a row
    is ever emitted."""
    if not probs.is_floating_point():
        probs = probs.double()
    elif probs.dtype in (torch.float16, torch.bfloat16):  # a half-precision running sum skips whole tokens
        probs = probs.float()
    cdf = probs.cumsum(-1)
    # One check for every kind of bad row: the uniform row's running sum 1..V replaces theirs.
    # A NaN or inf weight, or finite weights whose sum overflows, leave a total outside
    # (0, inf) (NaN fails both comparisons); a negative weight (or NaN) fails min >= 0: two
    # reductions instead of three elementwise passes and a reduction over [B, V].
    total = cdf[:, -1:]
    # On the CPU the check runs on the host (two reads; NaN fails every comparison) and the
    # replacement only when a row is bad; elsewhere it is a `where`, so that no sync is added.
    if cdf.device.type != "cpu" or (probs.numel() and not (all(0 < t < math.inf for t in total.view(-1).tolist())
                                                            and float(probs.min()) >= 0)):
        good = (total > 0) & (total < math.inf) & (probs.amin(-1, keepdim=True) >= 0)
        cdf = torch.where(good, cdf, torch.arange(1, probs.shape[-1] + 1, device=cdf.device, dtype=cdf.dtype))
        total = cdf[:, -1:]
    u = draw(torch.rand, probs.shape[0], 1, generator=generator, dtype=cdf.dtype, device=cdf.device) * total
    u = torch.minimum(u, torch.nextafter(total, _zero(cdf.dtype, cdf.device)))
    return torch.searchsorted(cdf, u, right=True).squeeze(-1)


_CONSTANTS: dict = {}


def shared_tensor(key: tuple, build) -> torch.Tensor:
    """The tensor `build()` made the first time `key` is asked for, then the same object: small
    constant tensors of the step's shapes (index ranges, masks) that were rebuilt every step
    otherwise (each a few microseconds on a CPU, where a step's bookkeeping is made of such
    calls). Shared by every caller: never write to it (callers hand out views of it)."""
    out = _CONSTANTS.get(key)
    if out is None:
        out = _CONSTANTS[key] = build()
    return out


def _device(device) -> torch.device | None:
    return device if device is None or isinstance(device, torch.device) else torch.device(device)


def _zero(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-dim zero of `dtype` on `device` (shared)."""
    return shared_tensor(("zero", dtype, _device(device)), lambda: torch.zeros((), dtype=dtype, device=device))


def cached_arange(start: int, stop: int, step: int = 1, device=None) -> torch.Tensor:
    """`torch.arange(start, stop, step)` (long) on `device`, built once per arguments
    (`shared_tensor`: never write to it)."""
    return shared_tensor(("arange", start, stop, step, _device(device)),
                         lambda: torch.arange(start, stop, step, device=device))


def normalize(weights: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Normalise non-negative weights [B, V] row-wise; rows whose mass is (numerically)
    zero take `fallback` [B, V] instead, so a degenerate residual (p == q) never yields NaN.
    Half-precision weights are normalised in float32 (their zero-mass floor is ~1 at V = 1024)."""
    if weights.dtype in (torch.float16, torch.bfloat16):
        weights, fallback = weights.float(), fallback.float()
    mass = weights.sum(-1, keepdim=True)
    floor = torch.finfo(weights.dtype).tiny * weights.shape[-1] * 16
    if weights.device.type == "cpu" and all(m > floor for m in mass.view(-1).tolist()):
        return weights / mass  # every row has mass (the usual case; checked on the host on a CPU)
    ok = mass > floor
    return torch.where(ok, weights / mass.clamp_min(torch.finfo(weights.dtype).tiny), fallback)


def check_distributions(name: str, probs: torch.Tensor | None) -> None:
    """Refuse rows that are not probability distributions (direct callers of a rule's `verify`
    or of `mmspec.tree.verify_tree`; the loop checks its own): NaN / inf / negative entries came
    out as NaN acceptance probabilities or distortion, an all-zero row fell back to uniform, a
    scaled one accepted every draft. Rows normalised in float32 and then cast to float64 are
    1e-6..1e-5 off 1 at large vocabularies, so the tolerance is 1e-3 from float32 up (1e-2 for
    half precision): what it catches (logits, zeroed or scaled rows) is far off. SYNC."""
    if probs is None or not probs.numel():
        return
    if not bool((torch.isfinite(probs) & (probs >= 0)).all()):
        raise ValueError(f"{name} must hold finite non-negative probabilities (after softmax), got NaN, inf or "
                         "negative entries; pass mmspec.process_logits(logits, ...) rather than logits")
    tol = 1e-3 if probs.dtype in (torch.float32, torch.float64) else 1e-2
    worst = float((probs.sum(-1, dtype=torch.float64) - 1).abs().max())
    if worst > tol:
        raise ValueError(f"{name} rows must each sum to 1 (distributions over the vocabulary), got a row "
                         f"{worst:.3g} away; pass mmspec.process_logits(logits, ...)")


def ids_in_range(ids: torch.Tensor, size: int) -> bool:
    """Every entry of `ids` in [0, size) (True when empty). SYNC."""
    return not ids.numel() or (int(ids.min()) >= 0 and int(ids.max()) < size)
