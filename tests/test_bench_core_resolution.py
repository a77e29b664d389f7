"""`mmspec bench core`'s resolution figures: how often a method exactly as fast as the best fixed
K would itself read below 0.95x the best fixed K in hindsight (bootstrap over the run's rounds),
and which cells lie significantly below a goal."""

from __future__ import annotations

import json
import math
import random

import pytest

from mmspec.bench.draft_length import _twin_below, resolution
from mmspec.cli import main


def test_twin_below_worked_by_hand():
    """One prompt set, three rounds. K=1 takes 1 s every round (the best by median); K=2 took
    0.9, 2 and 2 s. A draw resamples K=2's three rounds: its median is 0.9 s when at least two of
    the three draws are the 0.9 s round, P = 3 (1/3)^2 (2/3) + (1/3)^3 = 7/27; then the best in
    hindsight reads 0.9 s against the twin's 1 s: 0.9x, below 0.95. Otherwise 1.0x."""
    rounds = {"K=1": [1.0, 1.0, 1.0], "K=2": [0.9, 2.0, 2.0]}
    draws = 4000
    got = _twin_below(rounds, ["K=1", "K=2"], count=1, draws=draws, seed=3)
    sd = math.sqrt(7 / 27 * 20 / 27 / draws)
    assert abs(got - 7 / 27) < 4 * sd
    assert _twin_below(rounds, ["K=1", "K=2"], count=1, draws=draws, seed=3) == got  # seeded


def test_twin_below_follows_the_noise_of_the_rounds():
    """Six fixed K of equal speed over 8 rounds and 3 prompt sets: with 1% noise per round the
    run can tell a 5% loss (a twin of the best never reads below 0.95x); with 15% noise (this
    VM's calls vary 6-10%) a perfect controller reads below 0.95x in a large share of runs. A
    best K 25% ahead of the rest leaves no luck of selection: what remains at 10% noise is the
    twin's and the best K's own noise: the figure of that K alone (not 0)."""
    def rounds(noise, lead=1.0, seed=0):
        rng = random.Random(seed)
        out = {}
        for k in range(1, 7):
            base = [1.0, 1.5, 2.0]  # seconds of prompt sets 1, 2, 0 (round r runs set (r + 1) % 3)
            scale = 1.0 / lead if k == 3 else 1.0
            out[f"K={k}"] = [base[r % 3] * scale * math.exp(rng.gauss(0.0, noise)) for r in range(8)]
        return out

    fixed = [f"K={k}" for k in range(1, 7)]
    assert _twin_below(rounds(0.01), fixed, 3) == 0.0
    assert _twin_below(rounds(0.15), fixed, 3) > 0.25
    lead = _twin_below(rounds(0.10, lead=1.25), fixed, 3, draws=4000)
    alone = _twin_below(rounds(0.10, lead=1.25), ["K=3"], 3, draws=4000)
    assert 0.05 < alone and abs(lead - alone) < 0.03  # 4000 draws: sd <= 0.008 each


def test_resolution_counts_misses_and_cells_significantly_below_a_goal():
    rows = [
        {"pair": "weak", "batch": 1, "auto_vs_best_fixed": 0.93, "auto_vs_plain": 1.2, "twin_below_goal": 0.4,
         "auto_vs_best_fixed_ci90": [0.85, 1.01], "auto_vs_plain_ci90": [1.1, 1.3]},
        {"pair": "bench", "batch": 4, "auto_vs_best_fixed": 0.90, "auto_vs_plain": 0.96, "twin_below_goal": 0.1,
         "auto_vs_best_fixed_ci90": [0.86, 0.94], "auto_vs_plain_ci90": [0.93, 0.99]},
        {"pair": "strong", "batch": 8, "auto_vs_best_fixed": 1.01, "auto_vs_plain": 1.5, "twin_below_goal": 0.05,
         "auto_vs_best_fixed_ci90": [0.95, 1.07], "auto_vs_plain_ci90": [1.4, 1.6]},
    ]
    res = resolution(rows)
    assert res["misses_vs_best_fixed"] == 2 and res["misses_vs_plain"] == 1
    assert res["twin_expected_misses"] == pytest.approx(0.55)
    assert res["significantly_below_best_fixed"] == ["bench B=4"]  # weak B=1's interval reaches 1.01
    assert res["significantly_below_plain"] == ["bench B=4"]
    del rows[0]["twin_below_goal"]  # a report without rounds: no expectation rather than a partial one
    assert resolution(rows)["twin_expected_misses"] is None


def test_bench_core_reports_and_reanalyses_its_resolution(tmp_path, capsys):
    """A run with 2 rounds stores `twin_below_goal` per row and prints the resolution line;
    `--analyse` prints the same table from the JSON without running anything, and computes the
    figure for a stored report that predates it."""
    path = tmp_path / "core.json"
    assert main(["bench", "core", "--smoke", "--threads", "1", "--repeats", "2", "--batch-sizes", "1",
                 "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    report = json.loads(path.read_text())
    (row,) = report["rows"]
    assert 0.0 <= row["twin_below_goal"] <= 1.0
    assert "a method exactly as fast as the best fixed K would read" in printed
    assert main(["bench", "core", "--analyse", str(path)]) == 0
    again = capsys.readouterr().out
    assert again.splitlines()[-1] == [line for line in printed.splitlines() if line.startswith("misses:")][0]
    del row["twin_below_goal"]  # as in the reports of sessions 44-46
    old = tmp_path / "old.json"
    old.write_text(json.dumps(report))
    assert main(["bench", "core", "--analyse", str(old)]) == 0
    assert "would read < 0.95x in" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="cannot read a bench core report"):
        main(["bench", "core", "--analyse", str(tmp_path / "missing.json")])
    other = tmp_path / "other.json"  # another suite's report: rows of another form
    other.write_text(json.dumps({"info": {}, "rows": [{"method": "mmspec", "batch": 1}]}))
    with pytest.raises(SystemExit, match="is not a bench core report"):
        main(["bench", "core", "--analyse", str(other)])
