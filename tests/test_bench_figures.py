"""The arithmetic that turns timings into the published bench figures, with injected times (never
a wall clock): speed-ups and efficiency against their definitions, medians, per-round ranges,
images per second, forwards per image, and the "identical" flags turning False on a corrupted
output. Mutants of session 61 showed no test pinned these."""

from __future__ import annotations

import pytest
import torch

from mmspec.bench import core, gpu
from mmspec.bench import imagegen as ig
from mmspec.bench.pair import PairConfig


def test_core_rows_follow_their_definitions_and_the_identical_flag_is_computed(monkeypatch):
    fake = {"plain generate": 1.0, "transformers assisted": 0.8, "mmspec": 0.5, "ideal": 0.4}
    kern = {"stock": 1.0, "prepacked": 0.5}
    real = core._interleaved

    def interleaved(methods, repeats, samples=None, order="alternate"):
        _, outs = real(methods, repeats, samples, order)
        return {k: fake[k[0]] * kern[k[1]] for k in methods}, outs

    monkeypatch.setattr(core, "_interleaved", interleaved)
    pair = PairConfig(vocab_size=256, hidden_size=64, intermediate_size=128, target_layers=2, heads=4)
    cfg = core.BenchConfig(batch_sizes=(1, 2), num_draft_tokens=(2, 2), max_new_tokens=8, repeats=1, pair=pair)
    rows = core.run(cfg, progress=lambda m: None)["rows"]
    assert any(r["method"] == "mmspec" for r in rows)
    for r in rows:
        t = fake[r["method"]] * kern[r["kernels"]]
        want = {"tokens_per_s": round(r["batch"] * 8 / t, 1), "speedup_vs_plain": round(1.0 / t, 3),
                "speedup_vs_plain_same_kernels": round(kern[r["kernels"]] / t, 3)}
        if r["method"] == "mmspec":
            ideal = fake["ideal"] * kern[r["kernels"]]
            want.update(ideal_speedup=round(1.0 / ideal, 3), efficiency=round(ideal / t, 3))
            for peer in kern:
                if f"speedup_vs_assisted_{peer}" in r:
                    want[f"speedup_vs_assisted_{peer}"] = round(fake["transformers assisted"] * kern[peer] / t, 3)
            assert r["identical_to_plain"] is True
        assert {k: r[k] for k in want} == want, (r["method"], r["kernels"])
    import mmspec

    generate = mmspec.speculative_generate

    def corrupted(*a, **k):
        out = generate(*a, **k)
        out.sequences[:, -1] = (out.sequences[:, -1] + 1) % 256
        return out

    monkeypatch.setattr(mmspec, "speculative_generate", corrupted)
    rows = core.run(cfg, progress=lambda m: None)["rows"]
    assert all(r["identical_to_plain"] is False for r in rows if r["method"] == "mmspec")


def test_interleaved_timings_are_medians(monkeypatch):
    ticks = iter([0, 1, 10, 12, 20, 29])  # three timed calls: 1 s, 2 s, 9 s
    monkeypatch.setattr(core.time, "perf_counter", lambda: next(ticks))
    times, _ = core._interleaved({"a": lambda: None}, 3)
    assert times["a"] == 2


def test_image_bench_rows_follow_their_definitions(tmp_path, monkeypatch):
    from test_ar_image_pipeline import make_pipe

    make_pipe(torch.float32).save_pretrained(tmp_path / "gen")
    real = ig.run_method

    def run_method(pipe, labels, B, method, cfg, scale, seed):
        out = real(pipe, labels, B, method, cfg, scale, seed)
        r = seed // 1_000_003 - cfg.seed
        out["wall_s"] = 1.0 if method == "plain" else {1: 0.5, 2: 0.25}.get(r, 0.5)
        if method == "invariant/jacobi-gumbel" and r == 2:  # a differing token in round 2
            out["tokens"] = out["tokens"].clone()
            out["tokens"][0, -1] += 1
        return out

    monkeypatch.setattr(ig, "run_method", run_method)
    cfg = ig.ImageBenchConfig(model=str(tmp_path / "gen"), batch_sizes=(2,), images=3, repeats=2, threads=1,
                              draft_tokens=(2,), window=(4,),
                              methods=("plain", "exact/jacobi-maximal", "invariant/plain", "invariant/jacobi-gumbel"))
    rows = ig.run(cfg)["batches"][0]["methods"]
    j, p = rows["exact/jacobi-maximal"], rows["plain"]
    # two chunks (2 + 1 images) a round: jacobi 1.0 / 0.5 s a round, plain 2.0 s
    assert j["speedup_vs_plain"] == pytest.approx(2 / 0.75, abs=1e-3)
    assert j["speedup_rounds_min_max"] == pytest.approx([2.0, 4.0])
    assert j["images_per_s"] == pytest.approx(3 / 0.75, abs=1e-3)
    assert p["forwards_per_image"] == 16.0 and p["mean_accepted_length"] == 1.0
    assert rows["invariant/jacobi-gumbel"]["identical_to_invariant_plain"] is False
    chunks = [{"wall_s": 1.0, "forwards_per_image": fpi, "batch_forwards": 1, "tokens": torch.zeros(n, 4),
               "drafted_per_step": [], "images": n, "emitted": 1, "row_steps": 1} for n, fpi in ((2, 10.0), (1, 16.0))]
    assert ig.merge_runs(chunks)["forwards_per_image"] == pytest.approx(12.0)  # weighted by images


def test_gpu_bench_rows_follow_their_definitions(monkeypatch):
    secs = {"generate": 1.0, "mmspec plain": 1.1, "mmspec K=5": 0.5, "mmspec auto": 0.6, "ideal": 0.4}
    real = gpu._interleaved

    def interleaved(methods, repeats, samples=None, order="alternate"):
        _, outs = real(methods, repeats, samples, order)
        return {k: secs[k] for k in methods}, outs

    monkeypatch.setattr(gpu, "_interleaved", interleaved)
    cfg = gpu.GpuBenchConfig(shape="tiny", device="cpu", dtype="float32", workloads=(("text", 2),), max_new_tokens=16,
                             repeats=1)
    rows = {r["method"]: r for r in gpu.run(cfg, progress=lambda m: None)["rows"]}
    assert rows["mmspec K=5"]["speedup_vs_generate"] == pytest.approx(2.0)
    assert rows["mmspec K=5"]["efficiency"] == pytest.approx(0.8)


def test_bench_flags_keep_every_comma_separated_value():
    from mmspec.cli import _bench_config, build_parser

    config = _bench_config(build_parser().parse_args(["bench", "--batch-sizes", "1,8", "--draft-tokens", "4,3"]))
    assert tuple(config.batch_sizes) == (1, 8) and tuple(config.num_draft_tokens) == (4, 3)


def test_draft_length_rows_follow_their_definitions(monkeypatch):
    import mmspec
    from mmspec.bench import draft_length as dl

    secs = {"plain": 1.0, "mmspec plain": 1.1, "K=1": 0.8, "K=2": 0.5, "auto": 0.6, "assisted": 0.9,
            "assisted same kernels": 0.85}
    real = dl._interleaved

    def interleaved(methods, repeats, samples=None, order="alternate"):
        out = real(methods, repeats, samples, order)
        for k in samples:
            samples[k] = [secs[k]] * repeats
        return out

    monkeypatch.setattr(dl, "_interleaved", interleaved)
    pair = PairConfig(vocab_size=256, hidden_size=64, intermediate_size=128, target_layers=2, heads=4)
    cfg = dl.DraftLengthBench(pairs=("bench",), batch_sizes=(1,), fixed_k=(1, 2), k_max=3, max_new_tokens=8,
                              repeats=2, pair=pair, prompts=1)
    (row,) = dl.run(cfg, progress=lambda m: None)["rows"]
    assert "2" in str(row["best_fixed"]) and "1" not in str(row["best_fixed"])
    assert row["auto_vs_best_fixed"] == pytest.approx(0.5 / 0.6, abs=1e-3)
    assert row["identical_to_plain"] is True
    generate = mmspec.speculative_generate

    def corrupt_k2(target, drafter, *a, **k):
        out = generate(target, drafter, *a, **k)
        if getattr(drafter, "num_draft_tokens", None) == 2:
            out.sequences[:, -1] = (out.sequences[:, -1] + 1) % 256
        return out

    monkeypatch.setattr(mmspec, "speculative_generate", corrupt_k2)
    (row,) = dl.run(cfg, progress=lambda m: None)["rows"]
    assert row["identical_to_plain"] is False
    assert dl.resolution([{"pair": "p", "batch": 1, "auto_vs_best_fixed": 1.0, "auto_vs_plain": 1.0}])[
        "misses_vs_plain"] == 0  # exactly 1.0x plain is no miss


def test_vlm_bench_rows_use_medians_and_every_rounds_answers(monkeypatch):
    from collections import Counter

    from mmspec.bench import vlm

    real, calls = vlm._run, Counter()

    def run(pipe, m, images, prompts, B, cfg, seed):
        out, _ = real(pipe, m, images, prompts, B, cfg, seed)
        i = calls[m]
        calls[m] += 1  # call 0: warm-up, 1: round 1, 2: round 2
        if m == "vispec" and i == 1:
            out.sequences = [x.clone() for x in out.sequences]
            out.sequences[0][-1] += 1
        return out, {"plain": 1.0 if i == 1 else 3.0, "generate": 0.8}.get(m, 0.5 if i == 1 else 0.25)

    monkeypatch.setattr(vlm, "_run", run)
    cfg = vlm.VLMBenchConfig(num_scenes=2, batch_sizes=(2,), drafters=("vispec",), tasks=("caption",),
                             max_new_tokens=8, repeats=2, warmup_scenes=1, threads=1, verify_widths=(1, 4))
    v = vlm.run(cfg)["runs"][0]["methods"]["vispec"]
    assert v["speedup_vs_plain"] == pytest.approx(2 / 0.375, abs=1e-3)  # medians: plain 2.0 s, vispec 0.375 s
    assert v["identical_to_plain"] is False  # round 1's answer differed


def test_mar_bench_rows_use_medians(tmp_path, monkeypatch):
    from test_cli_mar import save_pair

    from mmspec.bench import mar

    folder = save_pair(tmp_path / "imagegen", metrics={"config": {"eval_num_iter": 4}})
    real = mar.run_chunk

    def run_chunk(pipe, chunk, call, seed, totals):
        wall, sec_t, calls_t = totals["wall"], totals["sec_t"], totals["calls_t"]
        real(pipe, chunk, call, seed, totals)
        plain = not call["speculative"] and call["num_iter"] == 4
        totals["wall"] = wall + (1.0 if plain else 0.5)
        r = seed // 100_003  # round r of seed 0
        totals["sec_t"] = sec_t + (totals["calls_t"] - calls_t) * (0.004 if r == 1 else 0.009)

    monkeypatch.setattr(mar, "run_chunk", run_chunk)
    rows = mar.run(mar.MARBenchConfig(model=str(folder), batch_sizes=(1,), num_images=2, repeats=2,
                                      threads=1))["batches"][0]["methods"]
    assert rows["cspd"]["speedup_vs_plain"] == pytest.approx(2.0)
    assert rows["plain"]["ms_per_target_call"] == pytest.approx(6.5)  # the median of 4 and 9 ms


def test_mar_cli_names_a_bad_num_images(tmp_path):
    from test_cli_mar import save_pair

    from mmspec.cli import main

    folder = save_pair(tmp_path / "imagegen", metrics={"config": {"eval_num_iter": 4}})
    with pytest.raises(SystemExit, match="--num-images"):
        main(["generate", "--model", str(folder), "--out", str(tmp_path / "out"), "--threads", "1", "--class", "1",
              "--num-images", "0"])
