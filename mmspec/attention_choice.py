"""Choose the attention backends of step forwards on a GPU by measuring them, not by assuming.

Why: speculative decoding gives almost every forward a shape never seen before. A verify
attends K + 1 queries over a key length that grows by a different amount every step (the
accepted run), a drafter's catch-up forward has as many queries as the step accepted, and with
an adaptive draft length the query count changes too. An attention backend that prepares a
plan per shape pays that preparation on every such step. cuDNN's fused attention is one: its
execution graph is built per (query length, key length) and cached by shape (see the cuDNN
backend discussions in pytorch/pytorch, e.g. PR 155958 on graphs rebuilt when the sequence
length changes, and ml-explore/mlx PR 2743: "the cuDNN graph is currently recreated whenever
sequence length increases"). A benchmark that repeats one request hides this (the second
request replays cached plans); a user's stream of different prompts does not.

What we do: on the first eager step forward on a CUDA device, for the model's head geometry
and dtype, time scaled-dot-product attention on *fresh* shapes (a key length not used before,
so a per-shape plan is paid as a real step pays it) for the verify form (K + 1 queries with a
4-D additive float mask, as mmspec passes it) and the one-token form (no mask), in alternating
rounds, under (a) the backends torch has enabled now (its own choice) and (b) the same set
without cuDNN attention. Each eager forward (prefill and steps) then runs under the faster set, through
`torch.nn.attention.sdpa_kernel` (which restores the caller's settings after the forward).
The set without cuDNN is only taken when it is at least 10% faster; otherwise nothing is
changed. Only backends the caller has enabled are ever used (we only ever remove cuDNN), only
while the math backend stays among them (it has a kernel for every input), and a set that fails
while measured leaves torch's choice; where cuDNN attention is already disabled, or on CPU,
nothing is measured.

The measurement is cached per (device, dtype, heads, kv heads, head dim) and the enabled
backends; it costs a few fresh-shape calls per candidate (on an H100 with cuDNN's ~85 ms plan
builds, about half a second, plus cuDNN's one-off library load if nothing loaded it before) and
is recorded, with its own seconds, in `choices()` for benchmarks to report.
`HFTarget(..., attention="torch")` / `ModelDrafter(..., attention="torch")` leave torch's
choice alone.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

MODES = ("auto", "torch")
MARGIN = 0.9  # the set without cuDNN must be at least 10% faster per fresh-shape step
SAMPLES = 4  # fresh shapes per candidate (fewer when one takes over the time cap)
TIME_CAP_S = 2.0  # stop sampling a candidate after this much time (a plan build can take 100s of ms)
VERIFY_QUERIES = 6  # the verify form: K + 1 = 6 queries
BASE_KEYS = 1000  # fresh key lengths start here, spaced so no two probes share a shape
_CACHE: dict = {}
_RECORD: dict = {}
_NEXT_KEY = [0]


def check_mode(attention) -> str:
    if attention not in MODES:
        raise ValueError(f"attention must be one of {MODES} ('auto': mmspec measures whether cuDNN attention's "
                         f"per-shape plans slow the step forwards on this GPU and leaves it out if so; 'torch': "
                         f"torch's own backend choice), got {attention!r}")
    return attention


def geometry(spec) -> tuple[int, int, int]:
    """(heads, kv heads, head dim) of a spec's model, from its config (a fallback for specs
    without one: the measurement's per-shape costs barely depend on it)."""
    config = getattr(getattr(spec, "model", None), "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return config_geometry(config)


def config_geometry(config) -> tuple[int, int, int]:
    """(heads, kv heads, head dim) from a config with transformers' names, else LlamaGen's
    (n_head, n_kv_head, dim); (32, 32, 128) when it has neither."""
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "dim", None)
    if not heads or not hidden:
        return 32, 32, 128
    kv_heads = getattr(config, "num_key_value_heads", None) or getattr(config, "n_kv_head", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return int(heads), int(kv_heads), int(head_dim)


def _enabled() -> list:
    from torch.nn.attention import SDPBackend

    flags = {SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled,
             SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled,
             SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.cudnn_sdp_enabled,
             SDPBackend.MATH: torch.backends.cuda.math_sdp_enabled}
    return [b for b, on in flags.items() if on()]


def _fresh_step_seconds(device, dtype, heads, kv_heads, head_dim) -> float:
    """Wall seconds of one verify-form and one one-token attention call on a key length not
    used before (synchronised, so a plan built on the host and the kernel are both counted)."""
    import torch.nn.functional as F

    _NEXT_KEY[0] += 1
    S = BASE_KEYS + 37 * _NEXT_KEY[0]
    Q = VERIFY_QUERIES
    noise = torch.Generator(device=device).manual_seed(S)  # its own: the user's global random stream is not drawn from
    q = torch.randn(1, heads, Q, head_dim, device=device, dtype=dtype, generator=noise)
    k = torch.randn(1, heads, S, head_dim, device=device, dtype=dtype, generator=noise)  # kv heads repeated, as HF's sdpa path does
    v = torch.randn(k.shape, device=device, dtype=dtype, generator=noise)
    vis = torch.ones(Q, S, dtype=torch.bool, device=device).tril(S - Q)
    mask = torch.zeros(1, 1, Q, S, dtype=dtype, device=device).masked_fill(~vis, torch.finfo(dtype).min)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    F.scaled_dot_product_attention(q[:, :, -1:], k, v)
    torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _measure(device, dtype, heads, kv_heads, head_dim) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    stock = _enabled()
    without = [b for b in stock if b != SDPBackend.CUDNN_ATTENTION]
    record = {"torch": [b.name for b in stock], "without_cudnn": [b.name for b in without]}
    if len(without) == len(stock) or SDPBackend.MATH not in without:
        # Without the math backend a set may have no kernel for some input (flash takes no float
        # mask): then torch's own choice stays, whatever the timings.
        why = "cuDNN attention is not enabled" if len(without) == len(stock) else "the math backend is disabled"
        record.update(chosen="torch", why=why)
        return {"backends": None, "record": record}
    start = time.perf_counter()
    sets = {"torch": stock, "without_cudnn": without}
    samples = {"torch": [], "without_cudnn": []}
    # A warm-up call each (library handles and kernels load once per process), then alternating
    # rounds; a candidate past the time cap with two samples is not sampled again.
    order = [("torch", False), ("without_cudnn", False)]
    for i in range(SAMPLES):
        order += [(n, True) for n in (("torch", "without_cudnn") if i % 2 == 0 else ("without_cudnn", "torch"))]
    for name, kept in order:
        if kept and sum(samples[name]) > TIME_CAP_S and len(samples[name]) >= 2:
            continue
        try:
            with sdpa_kernel(sets[name]):
                s = _fresh_step_seconds(device, dtype, heads, kv_heads, head_dim)
        except RuntimeError as e:  # no kernel of the set runs this input: keep torch's choice
            record.update(chosen="torch", why=f"{name} failed: {str(e).splitlines()[0][:200]}")
            return {"backends": None, "record": record}
        if kept:
            samples[name].append(s)
    ms = {name: statistics.median(v) * 1e3 for name, v in samples.items()}
    record["fresh_shape_ms"] = {name: round(v, 3) for name, v in ms.items()}
    take = ms["without_cudnn"] < MARGIN * ms["torch"]
    record["chosen"] = "without_cudnn" if take else "torch"
    record["measure_seconds"] = round(time.perf_counter() - start, 3)
    return {"backends": without if take else None, "record": record}


def backends_for(spec, device, dtype: torch.dtype, mode: str = "auto") -> list | None:
    """The measured backend set a step forward runs under (`torch.nn.attention.sdpa_kernel`),
    or None to leave torch's choice alone (CPU, mode "torch", or no gain measured)."""
    if mode != "auto" or torch.device(device).type != "cuda":
        return None
    return backends_for_geometry(device, dtype, *geometry(spec))


def backends_for_geometry(device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> list | None:
    """`backends_for` for a module that runs its own attention (an EAGLE head's layer)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    key = (str(device), dtype, heads, kv_heads, head_dim, tuple(b.name for b in _enabled()))
    choice = _CACHE.get(key)
    if choice is None:
        choice = _CACHE[key] = _measure(device, dtype, heads, kv_heads, head_dim)
        _RECORD[f"{device} {str(dtype).replace('torch.', '')} heads={heads}/{kv_heads} d={head_dim}"] = choice["record"]
    return choice["backends"]


def context(backends: list | None):
    """The context a forward runs in: `sdpa_kernel(backends)`, or a no-op for None."""
    if backends is None:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(backends)


def step_attention(x: torch.Tensor, config, mode: str = "auto"):
    """The context a module running its own attention on `x` enters: the measured backends
    on CUDA (mode "auto"), else a no-op (`config`: see `config_geometry`)."""
    if mode != "auto" or x.device.type != "cuda":
        check_mode(mode)  # "torch", or a value that is refused by name rather than ignored
        return contextlib.nullcontext()
    return context(backends_for_geometry(x.device, x.dtype, *config_geometry(config)))


def choices() -> dict:
    """What was measured and chosen in this process, per device and head geometry."""
    return {k: dict(v) for k, v in _RECORD.items()}
