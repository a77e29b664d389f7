"""Writing a benchmark's report as JSON: at the end, and after each finished part while it runs.

A device call or a CI job stopped at its time limit kills the benchmark with it; a report
written only at the end is then lost whole (session 38: `mmspec bench mar` on a GPU measured
batch 1 and was stopped during batch 8, leaving no file). So the benches pass
`partial_saver(path)` as their `checkpoint`: after each batch size the report so far is written
with ``"partial": true``, and the final `save` overwrites it without that key.
"""

from __future__ import annotations

import json
from pathlib import Path


def save(report: dict, path: str) -> None:
    """Write `report` to `path` as indented JSON (parent folders created)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


def partial_saver(path: str | None):
    """A checkpoint that writes the report so far, marked ``"partial": true``, to `path`
    (None without a path: nothing to write)."""
    if not path:
        return None
    return lambda report: save({**report, "partial": True}, path)
