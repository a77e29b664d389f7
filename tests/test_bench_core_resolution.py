"""`mmspec bench core`'s resolution figures: how often a method exactly as fast as the best fixed
K would itself read below 0.95x the best fixed K in hindsight (bootstrap over the run's rounds),
and which cells lie significantly below a goal."""

from __future__ import annotations

import json
import math
import random
import statistics

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


def _report(runs_seed, loss=0.9, noise=0.05, rounds=8, config=None):
    """A stored bench core report of one cell: K=2 the fastest fixed K, auto `loss` x its speed
    and plain 1/1.5 of auto's, every method's seconds times the same drift per round (the drift
    cancels in the paired ratios) and its own lognormal noise."""
    rng = random.Random(runs_seed)
    secs = {name: [] for name in ("plain", "K=1", "K=2", "K=3", "auto")}
    for _ in range(rounds):
        drift = math.exp(rng.gauss(0.0, 0.3))
        base = {"K=1": 1.2, "K=2": 1.0, "K=3": 1.25, "auto": 1.0 / loss, "plain": 1.5 / loss}
        for name, t in base.items():
            secs[name].append(t * drift * math.exp(rng.gauss(0.0, noise)))
    return {"config": config or {"pair": {"hidden_size": 512}, "max_new_tokens": 48},
            "rows": [{"pair": "bench", "batch": 1, "seconds_per_round": secs}]}


def test_pooled_ratio_worked_by_hand():
    """One run, two rounds: auto took 1 and 2 s, K=1 0.5 and 4 s, K=2 1 and 1 s. Log ratios
    t_K / t_auto: K=1 (log 0.5, log 2), mean 0; K=2 (0, log 0.5), mean -log(2)/2: K=2 is the
    faster, auto/best = 2^-0.5 = 0.707; sd of K=2's logs = log(2)/sqrt(2), 90% half-width
    t(1) = 6.314 x sd / sqrt(2) = 6.314 log(2) / 2."""
    from mmspec.bench.core_pooled import pool

    secs = {"auto": [1.0, 2.0], "K=1": [0.5, 4.0], "K=2": [1.0, 1.0], "plain": [2.0, 4.0]}
    (row,) = pool([{"config": {}, "rows": [{"pair": "bench", "batch": 1, "seconds_per_round": secs}]}])["rows"]
    assert row["best_fixed"] == "K=2" and row["rounds"] == 2
    assert row["auto_vs_best_fixed"] == pytest.approx(2 ** -0.5, abs=1e-3)
    half = 6.314 * math.log(2) / 2
    lo, hi = row["auto_vs_best_fixed_ci90"]
    assert lo == pytest.approx(math.exp(-math.log(2) / 2 - half), abs=1e-3)
    assert hi == pytest.approx(math.exp(-math.log(2) / 2 + half), abs=1e-3)
    assert row["auto_vs_plain"] == pytest.approx(2.0)


def test_pooled_runs_find_a_loss_one_run_cannot_call():
    """Three runs of 8 rounds, auto 0.90x the best fixed K with 5% noise per call. Over 400
    seeded pools the 90% interval holds the true 0.90 in 90% of them (within 4 sd of 400
    draws, 0.06), and lies wholly below 0.95 in most (the power check: a 10% loss is found in
    24 rounds); a controller exactly as fast as the best K is flagged (almost) never."""
    from mmspec.bench.core_pooled import format_pooled, pool, t90

    assert t90(10) == 1.812 and t90(45) == 1.684 and t90(1000) == 1.658
    with pytest.raises(ValueError, match="df"):
        t90(0)
    draws, covered, flagged, false = 400, 0, 0, 0
    for d in range(draws):
        lossy = pool([_report(3 * d + s) for s in range(3)])
        (row,) = lossy["rows"]
        assert row["best_fixed"] == "K=2" and row["runs"] == 3 and row["rounds"] == 24
        lo, hi = row["auto_vs_best_fixed_ci90"]
        covered += lo < 0.90 < hi
        flagged += hi < 0.95
        even = pool([_report(10_000 + 3 * d + s, loss=1.0) for s in range(3)])
        false += even["rows"][0]["auto_vs_best_fixed_ci90"][1] < 0.95
    assert abs(covered / draws - 0.90) < 4 * math.sqrt(0.09 / draws)
    assert flagged / draws > 0.8 and false / draws < 0.01
    assert row["auto_vs_plain"] == pytest.approx(1.5, rel=0.05)
    text = format_pooled(lossy)
    assert ("best fixed K bench B=1" in text) == (row["auto_vs_best_fixed_ci90"][1] < 0.95)
    assert "best fixed K none" in format_pooled(even) or false


def test_analyse_pools_several_reports_and_refuses_mixed_ones(tmp_path, capsys):
    paths = []
    for s in range(2):
        p = tmp_path / f"run{s}.json"
        rep = _report(s)
        rep["info"] = {"device": "test", "threads": 1, "pairs": {}}
        for row in rep["rows"]:  # the fields format_row reads
            t = {k: 48 / statistics.median(v) for k, v in row["seconds_per_round"].items()}
            row.update(tokens_per_s=t, best_fixed="K=2", auto_vs_best_fixed=round(t["auto"] / t["K=2"], 3),
                       auto_vs_plain=round(t["auto"] / t["plain"], 3), identical_to_plain=True)
        p.write_text(json.dumps(rep))
        paths.append(str(p))
    assert main(["bench", "core", "--analyse", *paths]) == 0
    out = capsys.readouterr().out
    assert "pooled over 2 reports" in out and "2 runs,  16 rounds" in out
    other = json.loads(open(paths[1]).read())
    other["config"]["max_new_tokens"] = 64
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="max_new_tokens"):
        main(["bench", "core", "--analyse", paths[0], str(bad)])
    for row in other["rows"]:
        del row["seconds_per_round"]
    other["config"]["max_new_tokens"] = 48
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(other))
    one = json.loads(open(paths[0]).read())
    for row in one["rows"]:
        del row["seconds_per_round"]
    bare0 = tmp_path / "bare0.json"
    bare0.write_text(json.dumps(one))
    with pytest.raises(SystemExit, match="nothing to pool"):
        main(["bench", "core", "--analyse", str(bare0), str(bare)])


def test_held_out_pick_worked_by_hand():
    """Two runs of one round. Run 0: auto 1 s, K=1 0.5 s, K=2 1 s; run 1: auto 1 s, K=1 2 s,
    K=2 0.8 s. Pooled, K=2 is the faster (logs 0, log 0.8 against log 0.5, log 2): auto/best
    = exp(log(0.8) / 2) = 0.894. Held out, run 0 is timed against run 1's pick
    (K=2: ratio 1) and run 1 against run 0's (K=1: ratio 2): auto/held out = sqrt(2)."""
    from mmspec.bench.core_pooled import pool

    runs = [{"auto": [1.0], "K=1": [0.5], "K=2": [1.0], "plain": [1.0]},
            {"auto": [1.0], "K=1": [2.0], "K=2": [0.8], "plain": [1.0]}]
    (row,) = pool([{"config": {}, "rows": [{"pair": "bench", "batch": 1, "seconds_per_round": r}]} for r in runs])["rows"]
    assert row["best_fixed"] == "K=2" and row["auto_vs_best_fixed"] == pytest.approx(math.sqrt(0.8), abs=1e-3)
    assert row["held_out_picks"] == ["K=2", "K=1"]
    assert row["auto_vs_held_out"] == pytest.approx(math.sqrt(2), abs=1e-3)
