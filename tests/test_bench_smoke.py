"""`mmspec bench --smoke` runs the whole benchmark on a tiny pair in seconds: every method
produces output identical to plain generate and the report has the expected rows."""

from __future__ import annotations

import json

import pytest

from mmspec.cli import main


def test_bench_smoke(tmp_path, capsys, monkeypatch):
    import mmspec.bench.report as report_module

    path = tmp_path / "bench.json"
    written, save = [], report_module.save  # each batch size's rows are written as they come, marked partial
    monkeypatch.setattr(report_module, "save", lambda r, p: (written.append(r.get("partial")), save(r, p)))
    assert main(["bench", "--smoke", "--threads", "1", "--json", str(path)]) == 0
    assert written == [True, True, None]  # after batch 1, after batch 2, the final report (it wrote only that)
    report = json.loads(path.read_text())
    rows = report["rows"]
    assert {r["batch"] for r in rows} == {1, 2}
    assert {r["method"] for r in rows} >= {"plain generate", "mmspec"}
    assert all(r["identical_to_plain"] for r in rows)
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert "mmspec" in capsys.readouterr().out
    assert report["info"]["order"] == report["config"]["order"] == "balanced"  # the default since session 52


def test_bench_runs_methods_in_the_order_asked(monkeypatch, tmp_path):
    from mmspec.bench import core

    seen = []
    real = core._interleaved

    def spy(methods, repeats, samples=None, order="alternate"):
        seen.append(order)
        return real(methods, repeats, samples, order)

    monkeypatch.setattr(core, "_interleaved", spy)
    path = tmp_path / "bench.json"
    assert main(["bench", "--smoke", "--threads", "1", "--order", "alternate", "--json", str(path)]) == 0
    assert seen == ["alternate", "alternate"]  # one interleaved block per batch size
    assert json.loads(path.read_text())["info"]["order"] == "alternate"
    with pytest.raises(ValueError, match="order must be one of"):
        core.BenchConfig(order="random")


@pytest.mark.cpu_attention  # the measured CPU attention choice, reported in the header (tests/conftest.py)
def test_bench_core_smoke(tmp_path, monkeypatch):
    """`mmspec bench core --smoke`: auto and fixed K rows, outputs identical to plain; the
    report names the attention forms mmspec's step forwards kept."""
    from mmspec import cpu_attention
    from mmspec.bench.draft_length import format_table

    import mmspec.bench.report as report_module

    cpu_attention.reset()
    path = tmp_path / "core.json"
    written, save = [], report_module.save  # each cell written as it comes, marked partial (it wrote only at the end)
    monkeypatch.setattr(report_module, "save", lambda r, p: (written.append((r["partial"], len(r["rows"]))), save(r, p)))
    assert main(["bench", "core", "--smoke", "--threads", "1", "--json", str(path)]) == 0
    assert written == [(True, 1), (True, 2)]
    report = json.loads(path.read_text())
    assert "partial" not in report
    attn = report["info"]["cpu_attention"]
    assert attn["classes"], "the batch-2 verify forwards were measured"
    assert all(c["form"] in cpu_attention.FORMS and c["rows"] <= 2 for c in attn["classes"])
    kept = sum(c["form"] == "matmul" for c in attn["classes"])
    assert attn["summary"].startswith(f"matmul in {kept} of {len(attn['classes'])} shape classes")
    assert f"mmspec step attention on CPU: {attn['summary']}" in format_table(report)
    cpu_attention.reset()
    rows = report["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    t1 = rows[0]["tokens_per_s"]  # at batch 1 assisted generation as shipped and on the same kernels as plain
    assert {"assisted", "assisted same kernels"} <= set(t1) and rows[0]["assisted_identical"]
    assert abs(rows[0]["auto_vs_assisted_same_kernels"] - t1["auto"] / t1["assisted same kernels"]) < 0.01
    for r in rows:
        assert r["identical_to_plain"] and {"plain", "mmspec plain", "auto", "K=1", "K=2"} <= set(r["tokens_per_s"])
        t = r["tokens_per_s"]  # mmspec's own plain decoding, beside generate's, separates loop and controller
        assert abs(r["auto_vs_mmspec_plain"] - t["auto"] / t["mmspec plain"]) < 0.01 * r["auto_vs_mmspec_plain"]
        assert abs(r["mmspec_plain_vs_plain"] - t["mmspec plain"] / t["plain"]) < 0.01 * r["mmspec_plain_vs_plain"]
        assert sum(r["auto_k_histogram"].values()) > 0
        # One paired ratio per timed round (the smoke run times one), consistent with the medians.
        assert len(r["auto_vs_plain_rounds"]) == 1 and len(r["auto_vs_best_fixed_rounds"]) == 1
        assert abs(r["auto_vs_plain_rounds"][0] - r["auto_vs_plain"]) < 2e-3
        assert len(r["seconds_per_round"]["auto"]) == 1 and "auto_vs_best_fixed_split" not in r  # needs 2 rounds


def test_bench_core_cells_cycle_prompt_sets_alike_for_every_method():
    """Round r runs prompt set (r + 1) mod n for every method (the warm-up call set 0); a
    method's time is the sum over the sets seen of its median seconds there (worked by hand)."""
    from mmspec.bench.core import _cycling
    from mmspec.bench.draft_length import DraftLengthBench, _workload_seconds

    seen = []
    m = _cycling(lambda j: seen.append(j) or f"out{j}", 3)
    for _ in range(7):  # warm-up + 6 rounds
        m()
    assert seen == [0, 1, 2, 0, 1, 2, 0] and m.outs == {0: "out0", 1: "out1", 2: "out2"}
    # rounds 0..5 ran sets 1, 2, 0, 1, 2, 0: medians 1.5 (set 1: 1, 2), 4 (set 2: 3, 5), 2.5 (set 0: 2, 3)
    assert _workload_seconds([1.0, 3.0, 2.0, 2.0, 5.0, 3.0], 3) == 1.5 + 4.0 + 2.5
    assert _workload_seconds([1.0, 3.0, 2.0, 2.0, 5.0, 3.0], 3, min) == 1.0 + 3.0 + 2.0
    assert _workload_seconds([4.0, 1.0, 2.0], 1) == 2.0  # one prompt: the median of the rounds
    with pytest.raises(ValueError, match="prompts must be an int >= 1"):
        DraftLengthBench(prompts=0)


def test_split_best_fixed_k_is_picked_and_timed_on_different_rounds():
    """The unbiased "best fixed K": chosen on even rounds, compared with auto on odd rounds only."""
    from mmspec.bench.draft_length import _split_best

    rounds = {  # seconds per round: K=1 looks best on the even rounds (0, 2), K=2 on the odd ones
        "K=1": [1.0, 3.0, 1.0, 3.0],
        "K=2": [2.0, 1.5, 2.0, 1.5],
        "auto": [2.0, 2.0, 2.0, 2.0],
    }
    got = _split_best(rounds, ["K=1", "K=2"])
    assert got["picked"] == "K=1"
    assert got["auto_vs_picked"] == 1.5  # K=1's odd rounds (3 s) against auto's (2 s)


def test_ratio_confidence_interval_is_a_t_interval_on_log_ratios():
    """Two rounds at 1.0x and 1.1x: logs 0 and 0.0953, sd 0.0674, t(1 df, 90%) = 6.314, so the
    interval is exp(0.0477 -+ 6.314 * 0.0674 / sqrt 2) = 0.776 .. 1.417 (worked by hand); equal
    rounds give a zero-width interval; one round gives none."""
    from mmspec.bench.draft_length import _ratio_ci

    lo, hi = _ratio_ci([1.0, 1.1])
    assert abs(lo - 0.776) <= 2e-3 and abs(hi - 1.417) <= 2e-3
    assert _ratio_ci([0.97] * 6) == [0.97, 0.97]
    assert _ratio_ci([1.2]) is None
    # More rounds with the same spread narrow it.
    wide, narrow = _ratio_ci([0.95, 1.05]), _ratio_ci([0.95, 1.05] * 4)
    assert narrow[0] > wide[0] and narrow[1] < wide[1]


def test_interleaved_rounds_alternate_their_order():
    """Rounds run A B C, then C B A, ...: no method always follows the same neighbour."""
    from mmspec.bench.core import _interleaved

    calls = []
    methods = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    samples: dict = {}
    _interleaved(methods, 3, samples)
    assert calls == list("abc") + list("abc") + list("cba") + list("abc")  # warm-up, then 3 rounds
    assert {k: len(v) for k, v in samples.items()} == {"a": 3, "b": 3, "c": 3}


def test_interleaved_balanced_order_follows_a_williams_design():
    """order="balanced": every method once per round, and a method's predecessor within a
    round changes from round to round; over the design's rows every ordered pair of methods is
    adjacent equally often (counted independently here, not from the construction)."""
    from collections import Counter

    from mmspec.bench.core import _interleaved, williams_rows

    for n in (2, 3, 4, 5, 9, 10):
        rows = williams_rows(n)
        assert len(rows) == (n if n % 2 == 0 else 2 * n)
        assert all(sorted(row) == list(range(n)) for row in rows)
        pairs = Counter((row[i - 1], row[i]) for row in rows for i in range(1, n))
        assert set(pairs) == {(a, b) for a in range(n) for b in range(n) if a != b}
        assert len(set(pairs.values())) == 1
    names = [f"m{i}" for i in range(10)]
    calls = []
    methods = {name: (lambda name=name: calls.append(name)) for name in names}
    samples: dict = {}
    _interleaved(methods, 10, samples, order="balanced")
    assert calls[:10] == names  # warm-up in list order
    rounds = [calls[10 + 10 * r: 20 + 10 * r] for r in range(10)]
    assert all(sorted(r) == sorted(names) for r in rounds)
    # The alternate order puts m9 after m8 or first in every round; here it follows 9 different
    # methods in 10 rounds (first in one).
    before = [r[r.index("m9") - 1] for r in rounds if r.index("m9") > 0]
    assert len(before) == 9 and len(set(before)) == 9
    with pytest.raises(ValueError, match="order"):
        _interleaved(methods, 1, order="shuffled")
    from mmspec.bench.draft_length import DraftLengthBench

    with pytest.raises(ValueError, match="order must be 'balanced' or 'alternate'"):
        DraftLengthBench(order="random")


def test_bench_core_fastest_round_figures(tmp_path):
    """With 2 rounds each row also gives the ratios of each method's fastest rounds, and they
    agree with the per-round seconds it reports: with one prompt set the fastest round; with
    three sets, 2 rounds ran sets 1 and 2 once each, so a method's figure is the sum of both."""
    for prompts, fastest in (("1", min), ("3", sum)):
        path = tmp_path / f"core{prompts}.json"
        assert main(["bench", "core", "--smoke", "--threads", "1", "--repeats", "2", "--batch-sizes", "1",
                     "--prompts", prompts, "--json", str(path)]) == 0
        report = json.loads(path.read_text())
        assert report["config"]["order"] == "balanced"  # the default method order, recorded
        (row,) = report["rows"]
        fr, secs = row["fastest_round"], row["seconds_per_round"]
        assert len(secs["auto"]) == 2 and row["prompt_sets"] == min(int(prompts), 2)  # sets the timed rounds ran
        calls = row["auto_per_call"]  # the warm-up call and the 2 timed ones
        assert all(len(v) == 3 for v in calls.values())
        assert all(0 <= p <= n for p, n in zip(calls["plain_steps"], calls["steps"]))
        # The last call's entry agrees with the row's histogram of that call.
        hist = row["auto_k_histogram"]
        assert calls["steps"][-1] == sum(hist.values()) and calls["plain_steps"][-1] == hist.get("0", 0)
        assert abs(calls["mean_k"][-1] - sum(int(k) * n for k, n in hist.items()) / sum(hist.values())) <= 0.005
        want = fastest(secs["plain"]) / fastest(secs["auto"])
        # The JSON's seconds are rounded to 0.1 ms (a smoke call takes a few ms), the ratio to 1e-3.
        rounding = want * (1e-4 / fastest(secs["plain"]) + 1e-4 / fastest(secs["auto"])) + 0.5e-3
        assert abs(fr["auto_vs_plain"] - want) < rounding + 1e-3 * want
        # The fastest fixed K: the JSON's seconds are rounded to 0.1 ms, so a near-tie may read
        # either way; the pick must be within that rounding of the fastest.
        best = min(fastest(secs[n]) for n in secs if n.startswith("K="))
        assert fr["best_fixed"].startswith("K=") and fastest(secs[fr["best_fixed"]]) <= best + 2e-4
    lo, hi = row["auto_vs_plain_ci90"]
    assert lo <= hi and lo <= max(row["auto_vs_plain_rounds"]) and hi >= min(row["auto_vs_plain_rounds"])


def test_bench_core_refuses_zero_repeats_instead_of_using_the_default():
    import pytest

    with pytest.raises(SystemExit, match="repeats"):
        main(["bench", "core", "--smoke", "--repeats", "0"])


def test_bench_and_demo_refuse_batch_sizes_draft_tokens_and_repeats_by_name():
    import pytest

    # Before: "num_draft_tokens needs one entry per batch size" for a batch size of 0, a K = 0
    # accepted, and `demo --repeats 0` ran the whole demo with 1.
    for argv, word in ((["bench", "--batch-sizes", "0"], "mmspec bench: batch_sizes must be ints >= 1"),
                       (["bench", "--draft-tokens", "0,3"], "mmspec bench: draft tokens must be ints >= 1"),
                       (["demo", "--repeats", "0"], "mmspec demo: repeats must be >= 1")):
        with pytest.raises(SystemExit, match=word):
            main(argv)


def test_bench_core_refuses_batch_sizes_and_draft_lengths_it_cannot_run():
    import pytest

    # Before: "max() arg is an empty sequence" (batch 0) or a negative-dimension RuntimeError,
    # deep in the prompt builder; a fixed K = 0 ran as a "best fixed K" row.
    for bad, word in ((["--batch-sizes", "0"], "batch_sizes"), (["--batch-sizes", "4,-1"], "batch_sizes"),
                      (["--fixed-k", "0,2"], "fixed_k"), (["--fixed-k", "9", "--k-max", "8"], "fixed_k")):
        with pytest.raises(SystemExit, match=word):
            main(["bench", "core", *bad])


def test_verify_widths_are_timed_warm(monkeypatch):
    """`time_widths` times each width after warm calls of that width: with a fake clock where a
    forward costs Q and a change of width costs 10 more (cold caches), the ratios are the warm
    ones; without warm calls the same clock gives the biased ratios (so the test can fail)."""
    import pytest

    from mmspec.bench import widths as W

    clock = {"t": 0.0, "last": None}
    order = []

    def call(Q):
        clock["t"] += Q + (10.0 if clock["last"] not in (None, Q) else 0.0)
        clock["last"] = Q
        order.append(Q)

    monkeypatch.setattr(W.time, "perf_counter", lambda: clock["t"])
    got = W.time_widths(call, (1, 4, 17), rounds=4, warm=2)
    assert got["seconds"] == {"1": 1.0, "4": 4.0, "17": 17.0}
    assert got["ratio_to_one_token"] == {"1": 1.0, "4": 4.0, "17": 17.0}
    assert order[:9] == [1, 1, 1, 4, 4, 4, 17, 17, 17] and order[9:12] == [17, 17, 17]  # reversed every other round
    cold = W.time_widths(call, (1, 4, 17), rounds=4, warm=0)
    assert cold["ratio_to_one_token"]["17"] < 17.0 / 2  # the bias the warm calls remove
    with pytest.raises(ValueError, match="include 1"):
        W.time_widths(call, (2, 4))


@pytest.mark.parametrize("argv", [["generate", "--class", "1", "--out", "OUT", "--threads", "-1"],
                                  ["generate", "--class", "1", "--out", "OUT", "--drafter", "jacobi", "--window", "0"],
                                  ["caption", "x.png", "--threads", "0"], ["bench", "--threads", "-1"],
                                  ["bench", "core", "--threads", "0"], ["bench", "vlm", "--threads", "-1"],
                                  ["testbed", "train-judge", "--out", "OUT", "--threads", "0"]],
                         ids=["generate", "window", "caption", "bench", "core", "vlm", "train-judge"])
def test_thread_counts_and_windows_below_one_are_argument_errors(argv, tmp_path, capsys):
    """Before: torch's "set_num_threads expects a positive integer" traceback after loading (a 0
    silently kept torch's default), and JacobiDrafter's ValueError as a traceback."""
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2 and "expected an int >= 1" in capsys.readouterr().err


def test_bench_imagegen_refuses_sampling_values_before_loading():
    """--temperature -1 / --guidance-scale -1 failed after the model had loaded and the verify cost
    was being measured."""
    from mmspec.bench.imagegen import ImageBenchConfig

    for kw, message in [(dict(temperature=-1.0), "temperature must be"), (dict(guidance_scale=-1.0), "guidance_scale"),
                        (dict(guidance_scale=float("nan")), "guidance_scale must be a finite number")]:
        with pytest.raises(ValueError, match=message):
            ImageBenchConfig(**kw)
    assert ImageBenchConfig(temperature=0.0, guidance_scale=1.0).guidance_scale == 1.0


def test_bench_imagegen_checks_the_judge_against_the_generator_before_timing(tmp_path):
    """A generator the judge cannot score (another image size or class count) was timed in full
    and then scored (accuracy 0.25, Frechet 386 for a 5-class 8x8 generator) or refused at the end."""
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from test_ar_image_pipeline import make_pipe

    from mmspec.bench.imagegen import check_judge
    from mmspec.testbed.judge_model import JUDGE_DIR

    pipe = make_pipe(torch.float32)
    with pytest.raises(ValueError, match="scores 64x64 testbed images of 32 classes; this generator makes"):
        check_judge(pipe, str(JUDGE_DIR))
    from mmspec.bench.imagegen import load_pipeline

    check_judge(load_pipeline(str(Path(__file__).resolve().parents[1] / "assets" / "testbed" / "imagegen")), str(JUDGE_DIR))


def test_bench_runs_mmspec_on_the_measured_mixed_kernels(tmp_path, monkeypatch):
    """Where the measurement mixes kernels by row count, the "prepacked" mmspec rows ran their own
    view (prepack=True: packed everywhere) while the forwards were recorded on the measured one:
    the ideal-engine replay found no forwards ('max() arg is an empty sequence')."""
    from mmspec.models import kernel_choice

    mixed = kernel_choice.KernelPolicy(kernel_choice.ROWS, (False, True, True, True, True))
    monkeypatch.setattr(kernel_choice, "measure", lambda model, *a, **k: {"prepack": True, "policy": mixed})
    path = tmp_path / "bench.json"
    assert main(["bench", "--smoke", "--threads", "1", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["info"]["mmspec_kernels"].startswith("mixed by rows (stock at 1, prepacked at 2")
    mine = [r for r in report["rows"] if r["method"] == "mmspec" and r["kernels"] != "stock"]
    assert mine and all(r["identical_to_plain"] for r in report["rows"])
