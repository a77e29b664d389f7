"""Measuring code behind `mmspec bench`, `mmspec demo` and the scripts in benchmarks/.
Speed is always a ratio measured side by side in one run; nothing here is a test."""

# `mmspec bench SUITE [options]`: suite name -> "module:function" taking the remaining argv.
# (`mmspec bench` without a suite runs the core A/B table of mmspec/bench/core.py.)
SUITES: dict[str, str] = {
    "core": "mmspec.bench.draft_length:main",
    "mar": "mmspec.bench.mar:main",  # MAR: plain sampling vs CSpD
    "vlm": "mmspec.bench.vlm:main",
    "gpu": "mmspec.bench.gpu:main",  # real-size shapes on a GPU, forced acceptance, vs the replay ideal
}
