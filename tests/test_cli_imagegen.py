"""`mmspec generate` and `mmspec bench imagegen --smoke` on a tiny pipeline folder: PNGs, the
side-by-side comparison, the JSON summary (greedy speculative tokens equal plain ones), and a
refused bad class id."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from mmspec.cli import main

from test_ar_image_pipeline import make_pipe


@pytest.fixture
def folder(tmp_path):
    pipe = make_pipe(torch.float32)
    pipe.save_pretrained(tmp_path / "gen")
    return tmp_path / "gen"


def test_a_class_given_twice_writes_every_image(folder, tmp_path, capsys):
    """--class 3 3 wrote both images to class03_0.png (summary.json listed it twice)."""
    out = tmp_path / "twice"
    main(["generate", "--model", str(folder), "--class", "3", "1", "3", "--num-images", "2", "--json", "--out", str(out)])
    files = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["files"]
    assert files == ["class03_0.png", "class03_1.png", "class01_0.png", "class01_1.png", "class03_2.png", "class03_3.png"]
    assert sorted(p.name for p in out.glob("class*.png")) == sorted(files)


def test_generate_compare_json(folder, tmp_path, capsys):
    out = tmp_path / "out"
    main(["generate", "--model", str(folder), "--class", "1", "3", "--num-images", "2", "--temperature", "0",
          "--guidance-scale", "3", "--compare", "--json", "--out", str(out)])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["images"] == 4 and summary["same_tokens_as_plain"] is True  # greedy: lossless
    assert summary["plain_target_forwards_per_image"] == 16.0 and summary["speedup"] > 0
    for name in summary["files"]:
        assert Image.open(out / name).size == (8, 8) and (out / ("plain_" + name)).is_file()
    assert Image.open(out / "compare.png").size == (2 * 16 + 4, 4 * 16)
    assert json.loads((out / "summary.json").read_text())["files"] == summary["files"]
    assert summary["rounds"] == 3
    with pytest.raises(SystemExit, match="--rounds times the --compare runs"):
        main(["generate", "--model", str(folder), "--class", "1", "--rounds", "5", "--out", str(tmp_path / "r")])


def test_compare_warms_up_at_the_timed_shapes_and_alternates_the_timed_rounds(monkeypatch):
    """`--compare` timing: one untimed call of each path, then rounds in which the two take turns
    to run first; the first outputs and the median seconds come back."""
    from mmspec import cli

    calls, clock = [], iter(range(100))
    monkeypatch.setattr("time.perf_counter", lambda: next(clock) * 1.0)

    def path(name):
        def call():
            calls.append(name)
            return f"{name}{len(calls)}"
        return call

    spec_out, plain_out, spec_s, plain_s = cli.timed_compare(path("s"), path("p"), 3)
    assert calls == ["s", "p", "s", "p", "p", "s", "s", "p"]
    assert (spec_out, plain_out) == ("s3", "p4")  # the first timed outputs, not the warm-up's
    assert spec_s == plain_s == 1.0  # each call advances the fake clock by one tick


def test_generate_invariant_sampling_matches_plain_and_window_implies_jacobi(folder, tmp_path, capsys):
    """--acceptance invariant at temperature 1: the speculative images are the plain ones for the
    seed. Before: --window without --drafter jacobi was ignored (the folder's drafter ran)."""
    main(["generate", "--model", str(folder), "--class", "1", "3", "--window", "5", "--acceptance", "invariant",
          "--compare", "--json", "--out", str(tmp_path / "inv")])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["same_tokens_as_plain"] is True and summary["lossless"] is True
    assert "JacobiDrafter(window=5" in summary["drafter"]
    with pytest.raises(SystemExit, match="--window set the Jacobi drafter"):
        main(["generate", "--model", str(folder), "--class", "1", "--drafter", "model", "--window", "4",
              "--out", str(tmp_path / "bad")])


def test_generate_jacobi_and_bad_class(folder, tmp_path, capsys):
    main(["generate", "--model", str(folder), "--class", "2", "--drafter", "jacobi", "--acceptance", "gsd",
          "--out", str(tmp_path / "j")])
    assert "JacobiDrafter" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown class id"):
        main(["generate", "--model", str(folder), "--class", "9", "--out", str(tmp_path / "bad")])
    with pytest.raises(SystemExit, match="--model"):
        main(["generate", "--model", str(tmp_path / "missing"), "--class", "1", "--out", str(tmp_path / "bad")])


def test_bench_imagegen_smoke(folder, tmp_path, capsys, monkeypatch):
    import mmspec.bench.report as report_module

    path = tmp_path / "bench.json"
    partial, write = [], report_module.save
    monkeypatch.setattr(report_module, "save", lambda r, p: (partial.append((r.get("partial"), len(r["batches"]))),
                                                              write(r, p)))
    main(["bench", "imagegen", "--model", str(folder), "--smoke", "--threads", "1", "--json", str(path)])
    # after each of the smoke run's two batch sizes (the final write goes through the patch too when
    # the bench module is first imported after it)
    assert [w for w in partial if w[0]] == [(True, 1), (True, 2)]
    report = json.loads(path.read_text())
    assert "partial" not in report
    rows = report["batches"][0]["methods"]
    assert set(rows) >= {"plain", "exact/model", "exact/jacobi-maximal", "lantern/model", "gsd/jacobi-maximal"}
    assert rows["plain"]["forwards_per_image"] == 16.0 and rows["plain"]["speedup_vs_plain"] == 1.0
    assert rows["plain"]["speedup_rounds_min_max"] == [1.0, 1.0]  # paired with itself, round by round
    for r in rows.values():
        lo, hi = r["speedup_rounds_min_max"]
        assert 0 < lo <= hi
    auto = rows["lantern/jacobi-maximal@auto"]
    assert auto["window"] == "auto" and sum(auto["windows_chosen"].values()) > 0
    # Methods take turns batch by batch with the same seeds: every invariant row, the auto window's
    # and the small-model drafter's included, emitted invariant/plain's tokens in every round.
    invariant = [m for m in rows if m.startswith("invariant/") and m != "invariant/plain"]
    assert len(invariant) >= 3 and all(rows[m]["identical_to_invariant_plain"] for m in invariant)
    assert rows["invariant/plain"]["lossless"] and "identical_to_invariant_plain" not in rows["exact/model"]
    assert "identical_to_invariant_plain" not in rows["invariant/plain"]  # the reference is not checked against itself
    assert report["batches"][0]["verify_cost"]["ratio_to_one_token"]["1"] == 1.0
    assert "speed-up" in capsys.readouterr().out
    assert report["model"]["device"] == "cpu" and report["config"]["device"] == "cpu"
    assert report["model"]["method_order"] == "balanced"


def test_bench_imagegen_rounds_follow_williams_rows(folder, monkeypatch):
    """Round r (0 = the warm-up) runs the methods in row r of the Williams design, the chunk
    after it reversed, so every method follows every other equally often over a cycle of rows."""
    from mmspec.bench import imagegen
    from mmspec.bench.core import williams_rows

    seen = []
    real = imagegen.run_method

    def spy(pipe, labels, B, method, cfg, scale, seed):
        seen.append((B, seed, method))
        return real(pipe, labels, B, method, cfg, scale, seed)

    monkeypatch.setattr(imagegen, "run_method", spy)
    methods = ["plain", "exact/jacobi-maximal", "invariant/plain", "gsd/jacobi-maximal"]
    cfg = imagegen.ImageBenchConfig(model=str(folder), batch_sizes=(1,), images=2, repeats=2, methods=tuple(methods),
                                    draft_tokens=(2,), window=(3,), threads=1)
    imagegen.run(cfg)
    rows = williams_rows(len(methods))
    for r in range(3):  # warm-up + 2 timed rounds, two chunks of one label each
        calls = [m for _, seed, m in seen if seed // 1_000_003 == cfg.seed + r]
        assert calls == [methods[i] for i in rows[r]] + [methods[i] for i in rows[r]][::-1]


def test_bench_imagegen_refuses_cuda_without_a_gpu(folder):
    import torch

    from mmspec.bench.imagegen import ImageBenchConfig

    if torch.cuda.is_available():  # a GPU machine accepts it (benchmarks/gpu_check.sh runs it there)
        assert ImageBenchConfig(device="cuda").device == "cuda"
    else:
        with pytest.raises(SystemExit, match="no CUDA device"):
            main(["bench", "imagegen", "--model", str(folder), "--smoke", "--device", "cuda"])


def test_bench_imagegen_refuses_windows_and_judge_counts_up_front(folder):
    # Before: a window of 0 failed after the pipeline was loaded, a judge count of 1 after every
    # timed run (both as tracebacks).
    for extra, word in ((["--window", "0,8"], "window must be ints >= 1"),
                        (["--judge-images", "1"], "judge_images must be 0 .no judge. or >= 2")):
        with pytest.raises(SystemExit, match=word):
            main(["bench", "imagegen", "--model", str(folder), *extra])


def test_bench_refuses_the_other_suites_options(folder):
    # `mmspec bench` and `mmspec bench imagegen` share one parser; an option only the other suite
    # reads was silently ignored before.
    with pytest.raises(SystemExit, match="--perturbation, --order do not apply to this suite"):
        main(["bench", "imagegen", "--model", str(folder), "--smoke", "--order", "alternate", "--perturbation", "0.1"])
    with pytest.raises(SystemExit, match="--window does not apply to this suite"):
        main(["bench", "--smoke", "--window", "4,4"])


def test_demo_image_section(folder, tmp_path):
    from mmspec.bench.imagegen import DEMO_METHODS, demo

    text = demo(str(folder), str(tmp_path / "demo"), threads=1)
    grid = Image.open(tmp_path / "demo" / "imagegen_methods.png")
    assert grid.size == (170 + 8 * 16, len(DEMO_METHODS) * 16)
    report = json.loads((tmp_path / "demo" / "imagegen_demo.json").read_text())
    assert [b["batch_size"] for b in report["batches"]] == [1, 8]
    assert all(m in text for m in DEMO_METHODS)
    # acceptance="invariant": the Jacobi row shows the plain row's images (same seed).
    rows = np.asarray(grid)[:, 170:].reshape(len(DEMO_METHODS), 16, -1, 3)
    a, b = DEMO_METHODS.index("invariant/plain"), DEMO_METHODS.index("invariant/jacobi-gumbel")
    assert np.array_equal(rows[a], rows[b]) and not np.array_equal(rows[a], rows[DEMO_METHODS.index("plain")])


def test_train_imagegen_refuses_guidance_below_one_before_training():
    """Its eval samples with LlamaGen's guidance, which refuses scales below 1 (llamagen_sample):
    the config says so up front instead of after the VQ and GPT stages."""
    from mmspec.testbed.imagegen_train import ImageGenTrainConfig

    ImageGenTrainConfig()
    with pytest.raises(ValueError, match="guidance_scale=0.5"):
        ImageGenTrainConfig(guidance_scale=0.5)
    with pytest.raises(ValueError, match="guidance_grid entry=0.0"):
        ImageGenTrainConfig(guidance_grid=(0.0, 2.0))


def test_train_imagegen_refuses_optimiser_and_sampling_settings_before_training():
    """A negative --lr trained the VQ stage for minutes and then the GPT away from the data;
    the config now refuses it, and the other optimiser / eval sampling settings, up front."""
    from mmspec.testbed.imagegen_train import ImageGenTrainConfig

    for kwargs, message in ((dict(lr=-1.0), "lr must be a finite number > 0"), (dict(lr=float("inf")), "lr must be"),
                            (dict(weight_decay=-0.1), "weight_decay and warmup must be >= 0"),
                            (dict(warmup=-1), "weight_decay and warmup must be >= 0"),
                            (dict(class_dropout_prob=1.0), r"class_dropout_prob must be in \[0, 1\)"),
                            (dict(temperature=-0.5), "temperature must be a finite number >= 0"),
                            (dict(top_k=0), "top_k must be None or in 1..vq_codebook_size=512"),
                            (dict(top_k=513), "top_k must be None or in 1..vq_codebook_size=512")):
        with pytest.raises(ValueError, match=message):
            ImageGenTrainConfig(**kwargs)
    ImageGenTrainConfig(top_k=512, temperature=0.0, warmup=0, weight_decay=0.0, class_dropout_prob=0.0)


def test_train_imagegen_and_train_vlm_refuse_empty_stages_and_a_missing_judge(tmp_path):
    """`--stages ,` ran nothing and exited 0; a missing --judge failed only in the eval stage, after
    the VQ and GPT stages had trained."""
    from mmspec.cli import main

    for command in ("train-imagegen", "train-vlm"):
        with pytest.raises(SystemExit, match="--stages names no stage"):
            main(["testbed", command, "--out", str(tmp_path / "x"), "--stages", ","])
    with pytest.raises(SystemExit, match="holds no judge"):
        main(["testbed", "train-imagegen", "--out", str(tmp_path / "x"), "--judge", str(tmp_path / "none")])
    assert not any(tmp_path.iterdir())  # refused before anything ran or was written
