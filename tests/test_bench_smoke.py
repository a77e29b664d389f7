"""`mmspec bench --smoke` runs the whole benchmark on a tiny pair in seconds: every method
produces output identical to plain generate and the report has the expected rows."""

from __future__ import annotations

import json

from mmspec.cli import main


def test_bench_smoke(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert main(["bench", "--smoke", "--threads", "1", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    rows = report["rows"]
    assert {r["batch"] for r in rows} == {1, 2}
    assert {r["method"] for r in rows} >= {"plain generate", "mmspec"}
    assert all(r["identical_to_plain"] for r in rows)
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert "mmspec" in capsys.readouterr().out
