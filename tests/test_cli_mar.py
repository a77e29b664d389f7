"""`mmspec generate`, `mmspec bench mar` and the MAR section of `mmspec demo` on tiny random MAR
pairs saved with save_pretrained: MAR folders are told from discrete ones by model_index.json,
options of the other kind are refused, --compare uses the same seeds (a drafter equal to the
target gives the plain images exactly), the JSON reports carry their fields."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from PIL import Image

from mmspec.cli import main

from test_mar_cspd import tiny_mar, tiny_vae


def save_pair(path, drafter="other", metrics=None, **over):
    from mmspec.pipelines import SpeculativeMARPipeline

    # the x0 clamp (as the testbed pair has) keeps a random head from diverging at t = 999, where
    # float32 rounding would be amplified ~1e4 times and even an identical drafter be rejected
    over = {"diffloss_clip_x0": 4.0, **over}
    target = tiny_mar(dtype=torch.float32, **over)
    d = copy.deepcopy(target) if drafter == "same" else tiny_mar(seed=3, dtype=torch.float32, **over)
    vae_levels = {16: 3, 64: 5}[target.config.img_size]
    SpeculativeMARPipeline(transformer=target, vae=tiny_vae(levels=vae_levels, dtype=torch.float32),
                           drafter=d).save_pretrained(path)
    if metrics is not None:
        (path / "metrics.json").write_text(json.dumps(metrics))
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    # named like a discrete generator on purpose: detection reads model_index.json, not the path
    return save_pair(tmp_path_factory.mktemp("m") / "imagegen", metrics={"config": {"eval_num_iter": 4}})


def _generate(folder, out, *extra):
    main(["generate", "--model", str(folder), "--out", str(out), "--threads", "1", *extra])


def test_generate_compare_json(folder, tmp_path, capsys):
    out = tmp_path / "out"
    _generate(folder, out, "--class", "1", "3", "--num-images", "2", "--compare", "--json")
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert s["pipeline"] == "SpeculativeMARPipeline" and s["images"] == 4 and s["num_iter"] == 4  # metrics.json default
    assert s["plain_target_forwards_per_image"] == 4.0  # plain MAR: one target call per step
    assert s["target_forwards_per_image"] <= 4.0 and s["draft_forwards_per_image"] > 0
    assert 0.0 <= s["acceptance_rate"] <= 1.0 and s["fallbacks"] >= 0 and s["speedup"] > 0
    assert s["judged_tokens"] > 0 and s["accepted_tokens"] <= s["judged_tokens"]
    for name in s["files"]:
        assert Image.open(out / name).size == (16, 16) and (out / ("plain_" + name)).is_file()
    assert Image.open(out / "compare.png").size == (2 * 32 + 4, 4 * 32)
    assert json.loads((out / "summary.json").read_text())["files"] == s["files"]


def test_generate_compare_uses_the_same_seed(tmp_path, capsys):
    # drafter == target: every draft is accepted and CSpD reproduces plain sampling image for image
    folder = save_pair(tmp_path / "same", drafter="same")
    out = tmp_path / "out"
    _generate(folder, out, "--class", "0", "4", "--num-iter", "6", "--guidance-scale", "2", "--compare", "--json")
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert s["acceptance_rate"] == 1.0 and s["residual_tokens"] == 0 and s["target_forwards_per_image"] < 6
    for name in s["files"]:
        assert np.array_equal(np.asarray(Image.open(out / name)), np.asarray(Image.open(out / ("plain_" + name))))


def test_generate_draft_self(folder, tmp_path, capsys):
    out = tmp_path / "out"
    _generate(folder, out, "--class", "2", "--num-images", "2", "--draft", "self", "--json")
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert s["speculative"] == "cspd-self" and s["draft"] == "self" and s["num_draft_steps"] == 3
    assert "prefill_fraction" not in s and s["draft_forwards_per_image"] > 0 and len(s["files"]) == 2
    with pytest.raises(SystemExit, match="prefill_fraction is for draft='model'"):
        _generate(folder, tmp_path / "x", "--class", "1", "--draft", "self", "--prefill-fraction", "0.2")
    with pytest.raises(SystemExit, match="it takes only acceptance='continuous'"):
        _generate(folder, tmp_path / "x", "--class", "1", "--draft", "self", "--acceptance", "continuous-relaxed")


def test_generate_refuses_options_of_the_other_kind(folder, tmp_path):
    from test_ar_image_pipeline import make_pipe

    bad = [(("--drafter", "jacobi"), "--drafter jacobi"), (("--acceptance", "lantern"), "continuous-token rule"),
           (("--window", "8"), "--window"), (("--top-k", "5"), "--top-k"), (("--coupling", "gumbel"), "--coupling")]
    for extra, msg in bad:
        with pytest.raises(SystemExit, match=msg):
            _generate(folder, tmp_path / "x", "--class", "1", *extra)
    with pytest.raises(SystemExit, match="--class 5 is out of range: this MAR has classes 0..4"):
        _generate(folder, tmp_path / "x", "--class", "1", "5")
    for n in ("0", "17"):  # 16 tokens
        with pytest.raises(SystemExit, match="num_iter must be an int in \\[1, 16\\]"):
            _generate(folder, tmp_path / "x", "--class", "1", "--num-iter", n)
    discrete = tmp_path / "mar"  # a discrete generator in a folder named like a MAR one
    make_pipe(torch.float32).save_pretrained(discrete)
    for extra, flag in ((("--num-iter", "4"), "--num-iter"), (("--cfg-schedule", "constant"), "--cfg-schedule"),
                        (("--num-draft-steps", "2"), "--num-draft-steps"), (("--draft", "self"), "--draft")):
        with pytest.raises(SystemExit, match=f"{flag} is for MAR folders"):
            _generate(discrete, tmp_path / "x", "--class", "1", *extra)


def test_bench_mar_json(folder, tmp_path, capsys, monkeypatch):
    import mmspec.bench.report as report_module

    path = tmp_path / "bench.json"
    partial, write = [], report_module.save
    # each batch size's figures are written as soon as they exist, marked partial (a run stopped at a
    # time limit keeps them); the final write replaces them without the mark
    monkeypatch.setattr(report_module, "save", lambda r, p: (partial.append((p, r.get("partial"), len(r["batches"]))),
                                                              write(r, p)))
    main(["bench", "mar", "--model", str(folder), "--batch-sizes", "1", "2", "--num-images", "3", "--repeats", "1",
          "--threads", "1", "--json", str(path)])
    assert [w for w in partial if w[1]] == [(str(path), True, 1), (str(path), True, 2)]
    report = json.loads(path.read_text())
    assert "partial" not in report
    assert [b["batch_size"] for b in report["batches"]] == [1, 2] and "judge" not in report  # judge off by default
    assert report["config"]["num_iter"] == 4 and report["model"]["image_tokens"] == 16
    assert report["config"]["temperature"] == 1.0  # no metrics.json: MAR's own default
    for b in report["batches"]:
        plain, cspd = b["methods"]["plain"], b["methods"]["cspd"]
        assert plain["target_forwards_per_image"] == 4.0 and plain["draft_forwards_per_image"] == 0
        assert plain["speedup_vs_plain"] == 1.0 and plain["acceptance_rate"] is None
        assert cspd["target_forwards_per_image"] <= 4.0 and cspd["draft_forwards_per_image"] > 0
        assert 0.0 <= cspd["acceptance_rate"] <= 1.0 and cspd["fallbacks"] >= 0 and cspd["speedup_vs_plain"] > 0
        relaxed = b["methods"]["cspd-relaxed"]
        assert 0.0 <= relaxed["acceptance_rate"] <= 1.0 and relaxed["draft_forwards_per_image"] > 0
        own = b["methods"]["cspd-self"]  # the target drafting from its own earlier conditioning
        assert own["target_forwards_per_image"] <= 4.0 and own["draft_forwards_per_image"] > 0
        assert 0.0 <= own["acceptance_rate"] <= 1.0 and own["fallbacks"] >= 0
        # the fewer-steps peers (default: half and a quarter of the 4 steps): one target forward per step
        assert list(b["methods"])[4:] == ["plain@2", "plain@1"]
        for n in (2, 1):
            peer = b["methods"][f"plain@{n}"]
            assert peer["target_forwards_per_image"] == n and peer["draft_forwards_per_image"] == 0
    assert report["config"]["inner_temperature"] == 42.0
    text = capsys.readouterr().out
    assert "speed-up" in text and "cspd-relaxed" in text
    main(["bench", "mar", "--model", str(folder), "--batch-sizes", "1", "--num-images", "1", "--repeats", "1",
          "--threads", "1", "--inner-temperature", "0", "--plain-iters", "0", "--json", str(path)])
    assert list(json.loads(path.read_text())["batches"][0]["methods"]) == ["plain", "cspd", "cspd-self"]
    main(["bench", "mar", "--model", str(folder), "--batch-sizes", "1", "--num-images", "1", "--repeats", "1",
          "--threads", "1", "--inner-temperature", "0", "--self-draft-steps", "0", "--plain-iters", "0",
          "--json", str(path)])
    assert list(json.loads(path.read_text())["batches"][0]["methods"]) == ["plain", "cspd"]
    main(["bench", "mar", "--model", str(folder), "--batch-sizes", "1", "--num-images", "1", "--repeats", "1",
          "--threads", "1", "--inner-temperature", "0", "--self-draft-steps", "0", "--plain-iters", "3,3",
          "--json", str(path)])
    assert list(json.loads(path.read_text())["batches"][0]["methods"]) == ["plain", "cspd", "plain@3"]
    with pytest.raises(SystemExit, match=r"plain_iters \[9\] are not fewer than the 4 generation steps"):
        main(["bench", "mar", "--model", str(folder), "--num-images", "1", "--plain-iters", "3,9"])
    with pytest.raises(SystemExit, match="--plain-iters takes integers"):
        main(["bench", "mar", "--model", str(folder), "--plain-iters", "half"])
    # per-call costs: a plain step, a verify call, a drafter step; a cheaper drafter head on request
    m = json.loads(path.read_text())["batches"][0]["methods"]
    assert m["plain"]["ms_per_target_call"] > 0 and m["plain"]["ms_per_draft_call"] is None
    assert m["cspd"]["ms_per_target_call"] > 0 and m["cspd"]["ms_per_draft_call"] > 0
    head = json.loads(path.read_text())["model"]["head_steps"]
    main(["bench", "mar", "--model", str(folder), "--batch-sizes", "1", "--num-images", "1", "--repeats", "1",
          "--threads", "1", "--inner-temperature", "0", "--draft-head-steps", "2", "--json", str(path)])
    report = json.loads(path.read_text())
    assert report["model"]["drafter_head_steps"] == 2 and report["model"]["head_steps"] == head > 2
    assert report["batches"][0]["methods"]["cspd"]["draft_forwards_per_image"] > 0
    with pytest.raises(SystemExit, match="draft_head_steps must be >= 2"):
        main(["bench", "mar", "--model", str(folder), "--draft-head-steps", "1"])
    with pytest.raises(SystemExit, match="inner_temperature must be 0"):
        main(["bench", "mar", "--model", str(folder), "--inner-temperature", "0.5"])


def test_bench_mar_refusals(folder, tmp_path, monkeypatch):
    import mmspec.bench.mar as bench_mar

    monkeypatch.setattr(bench_mar, "BUNDLED_MAR", tmp_path / "no_such_pair")
    with pytest.raises(SystemExit, match="no --model given and no bundled MAR pair.*mmspec testbed train-mar --out DIR"):
        main(["bench", "mar"])
    with pytest.raises(SystemExit, match="not a SpeculativeMARPipeline folder"):
        main(["bench", "mar", "--model", str(tmp_path)])
    with pytest.raises(SystemExit, match="scores 64x64 testbed images of 32 classes; this MAR makes 16x16 images of 5"):
        main(["bench", "mar", "--model", str(folder), "--judge", str(bench_mar.JUDGE_DIR), "--num-images", "1"])
    if not torch.cuda.is_available():  # the device is checked before the pipeline is loaded
        with pytest.raises(SystemExit, match="device='cuda' asked for but torch sees no CUDA device"):
            main(["bench", "mar", "--model", str(folder), "--device", "cuda"])
    # the judge is on by default only for folders that `mmspec testbed train-mar` made
    assert bench_mar._judge_default(str(folder)) is None
    trained = save_pair(tmp_path / "trained", metrics={"judge_vae_recon": {"accuracy": 0.5}})
    assert bench_mar._judge_default(str(trained)) == str(bench_mar.JUDGE_DIR)


def test_bench_mar_judge_scores_both_methods(tmp_path):
    from mmspec.bench.mar import JUDGE_DIR, MARBenchConfig, run

    folder = save_pair(tmp_path / "world", img_size=64, vae_stride=16, class_num=32)
    report = run(MARBenchConfig(model=str(folder), batch_sizes=(2,), num_images=2, repeats=1, num_iter=3,
                                threads=1, judge=str(JUDGE_DIR), judge_images=4))
    assert list(report["judge"]) == ["plain", "cspd", "cspd-self", "cspd-relaxed", "plain@1"]  # 3 // 2 = 1, 3 // 4 = 0 dropped
    for m in ("plain", "cspd", "cspd-self", "cspd-relaxed", "plain@1"):
        s = report["judge"][m]
        assert s["images"] == 4 and 0.0 <= s["accuracy"] <= 1.0 and s["frechet"] >= 0.0


def test_demo_mar_section(folder, tmp_path):
    from mmspec.bench.mar import demo_section

    text = demo_section(str(tmp_path / "demo"), model=tmp_path / "absent")
    assert "\n" not in text and "MAR section skipped" in text and "mmspec testbed train-mar" in text
    assert not (tmp_path / "demo").exists()
    text = demo_section(str(tmp_path / "demo"), model=folder, threads=1)
    assert Image.open(tmp_path / "demo" / "mar_plain_vs_cspd.png").size == (4 * 32, 3 * 32)  # plain, cspd, cspd-self
    report = json.loads((tmp_path / "demo" / "mar_demo.json").read_text())
    assert report["config"]["warmup_chunks"] == 1  # the warm-up samples one batch per method, not a round
    assert [b["batch_size"] for b in report["batches"]] == [1, 4] and "speed-up" in text
    assert report["config"]["num_iter"] == 16  # one token a step (4 x 4 tokens), not the folder's default


@pytest.mark.parametrize("warmup_chunks,warm", [(None, 3), (1, 1)])
def test_the_warmup_round_samples_as_many_batches_as_asked(folder, monkeypatch, warmup_chunks, warm):
    import mmspec.bench.mar as mb

    seen = []
    real = mb.run_chunk
    monkeypatch.setattr(mb, "run_chunk", lambda pipe, chunk, call, seed, totals: (seen.append(seed), real(pipe, chunk, call, seed, totals)))
    cfg = mb.MARBenchConfig(model=str(folder), batch_sizes=(1,), num_images=3, repeats=1, num_iter=2, threads=1,
                            inner_temperature=0, plain_iters=(), warmup_chunks=warmup_chunks)
    report = mb.run(cfg)
    n = len(mb.methods(cfg))
    assert len(seen) == n * (warm + 3)  # warm-up batches, then a full timed round of 3
    assert report["batches"][0]["methods"]["plain"]["target_forwards_per_image"] == 2.0  # timed round: 3 whole images


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1"])
def test_a_bad_warmup_chunks_is_refused_by_name(bad):
    from mmspec.bench.mar import MARBenchConfig

    with pytest.raises(ValueError, match="warmup_chunks"):
        MARBenchConfig(warmup_chunks=bad)


def test_a_folders_unreadable_metrics_are_refused_not_replaced_by_defaults(tmp_path):
    """mar_defaults / the bench's judge default read metrics.json; a file that did not parse, or
    a value of the wrong type, silently gave MAR's 64 steps at temperature 1.0 and no judge."""
    from types import SimpleNamespace

    import mmspec.bench.mar as bench_mar
    from mmspec.pipelines.mar_cli import mar_defaults

    pipe = SimpleNamespace(transformer=SimpleNamespace(seq_len=16))
    metrics = tmp_path / "metrics.json"
    metrics.write_text(json.dumps({"config": {"eval_num_iter": 4.0, "eval_temperature": 0.7, "eval_guidance": 0}}))
    assert mar_defaults(tmp_path, pipe) == {"num_iter": 4, "guidance_scale": 0.0, "temperature": 0.7}
    metrics.write_text(json.dumps({"config": {}}))
    assert mar_defaults(tmp_path, pipe) == {"num_iter": 16, "guidance_scale": 3.0, "temperature": 1.0}
    for bad, message in [({"config": {"eval_num_iter": 4.5}}, r"config.eval_num_iter = 4.5 is not a whole number > 0"),
                         ({"config": {"eval_num_iter": "16"}}, r"config.eval_num_iter = '16' is not a whole number"),
                         ({"config": {"eval_temperature": 0}}, r"config.eval_temperature = 0 is not a number > 0"),
                         ({"config": {"eval_guidance": True}}, r"config.eval_guidance = True is not a number >= 0"),
                         ({"config": [1]}, r"'config' is a list, not an object"),
                         ([1, 2], r"holds a list, not a JSON object")]:
        metrics.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            mar_defaults(tmp_path, pipe)
    metrics.write_text(json.dumps({"config": {"eval_num_iter": 16}, "judge_vae_recon": {}})[:-1])  # one byte short
    assert (bench_mar.JUDGE_DIR / "config.json").is_file()  # (the judge default reads metrics.json only then)
    for read in (lambda: mar_defaults(tmp_path, pipe), lambda: bench_mar._judge_default(str(tmp_path))):
        with pytest.raises(ValueError, match=r"metrics.json is not valid JSON .*; fix or remove the file"):
            read()
