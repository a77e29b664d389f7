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
