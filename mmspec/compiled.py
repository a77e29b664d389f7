"""The opt-in compiled step forward: `compile=` options and the `torch.compile` wrapper.

What: a spec's per-step forward (embed -> backbone -> head over a `StaticKV`,
mmspec/static_kv.py) wrapped in `torch.compile(..., dynamic=False)`. Static shapes make one
trace per forward kind serve a whole request (the target's verify; a drafter's catch-up and
draft steps), so `mode="reduce-overhead"` can replay it as a CUDA graph.

Why opt-in: on CPU, eager decoding of small models is faster without it (compile time, and
the static store attends over the whole capacity); the GPU is where it pays.

The `compile` option of `SpecTarget` / `HFTarget` / `ModelDrafter`:
- None / False: eager (the default);
- True: `torch.compile` defaults (inductor);
- a mode string: `"default"`, `"reduce-overhead"` (CUDA graphs), `"max-autotune"`,
  `"max-autotune-no-cudagraphs"`;
- a dict of `torch.compile` keywords: `backend`, `mode`, `options`, `fullgraph`
  (e.g. `{"backend": "aot_eager"}` to check tracing on CPU without a C++ compiler).
`dynamic` is always False (that is the point) and is refused if given.

Limits: the prefill and the commit bookkeeping run eagerly; the compiled region holds no
host sync (`.item()`, `.tolist()`): the engine's one sync per step stays the only one.
Tested on CPU (backends "eager" / "aot_eager") and on an NVIDIA H200 with inductor and
CUDA graphs (tests/test_core_cuda.py; docs/architecture.md, "GPU path").
"""

from __future__ import annotations

from typing import Any, Callable

import torch

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
KEYS = ("backend", "mode", "options", "fullgraph")


def compile_options(compile: Any) -> dict[str, Any] | None:
    """Normalise the `compile` option to `torch.compile` keywords (None: no compile)."""
    if compile is None or compile is False:
        return None
    if compile is True:
        return {}
    if isinstance(compile, str):
        if compile not in MODES:
            raise ValueError(f"compile={compile!r} is not a torch.compile mode; use True, one of {MODES} or a dict "
                             f"with keys {KEYS}")
        return {"mode": compile}
    if isinstance(compile, dict):
        if "dynamic" in compile:
            raise ValueError("compile={'dynamic': ...} is not accepted: the static path always compiles with "
                             "dynamic=False (static shapes); remove the key")
        unknown = sorted(set(compile) - set(KEYS))
        if unknown:
            raise ValueError(f"compile options {unknown} are not supported; use keys from {KEYS}")
        mode = compile.get("mode")
        if mode is not None and mode not in MODES:
            raise ValueError(f"compile mode {mode!r} is not a torch.compile mode; use one of {MODES}")
        backend = compile.get("backend")
        if backend is not None and not (isinstance(backend, str) or callable(backend)):
            raise TypeError(f"compile backend must be a name or a callable, got {type(backend).__name__}")
        return dict(compile)
    raise TypeError(f"compile must be None, a bool, a mode string or a dict of torch.compile keywords, got "
                    f"{type(compile).__name__}")


def static_and_compile(static: bool | None, compile: Any) -> tuple[bool, dict[str, Any] | None]:
    """Resolve the (static, compile) pair of a target or drafter: compile implies static;
    `static=False` with compile is refused (a compiled forward over growing shapes recompiles
    every step)."""
    options = compile_options(compile)
    if static is not None and not isinstance(static, bool):
        raise TypeError(f"static must be a bool, got {type(static).__name__}")
    if options is not None and static is False:
        raise ValueError(f"compile={compile!r} needs static shapes: drop static=False (compile turns static on)")
    return bool(static) or options is not None, options


def uses_cuda_graphs(options: dict[str, Any] | None) -> bool:
    return options is not None and (options.get("mode") == "reduce-overhead" or options.get("backend") == "cudagraphs")


def compiled(fn: Callable, options: dict[str, Any]) -> Callable:
    """`torch.compile(fn, dynamic=False, **options)`."""
    return torch.compile(fn, dynamic=False, **options)
