"""Measuring code behind `mmspec bench`, `mmspec demo` and the scripts in benchmarks/.
Speed is always a ratio measured side by side in one run; nothing here is a test."""

# Method orders within a round of interleaved timing (`mmspec.bench.core._interleaved`), shared by
# the suites and the CLI (this module imports nothing heavy).
ORDERS = ("alternate", "balanced")


def check_order(order: str) -> None:
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")


# `mmspec bench SUITE [options]`: suite name -> "module:function" taking the remaining argv.
# (`mmspec bench` without a suite runs the core A/B table of mmspec/bench/core.py.)
SUITES: dict[str, str] = {
    "core": "mmspec.bench.draft_length:main",
    "mar": "mmspec.bench.mar:main",  # MAR: plain sampling vs CSpD
    "vlm": "mmspec.bench.vlm:main",
    "gpu": "mmspec.bench.gpu:main",  # real-size shapes on a GPU, forced acceptance, vs the replay ideal
}
