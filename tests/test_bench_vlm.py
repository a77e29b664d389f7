"""`mmspec bench vlm` on the bundled testbed VLM, tiny settings: every method's answers equal
plain decoding, the tree and adaptive-length variants are registered from the saved drafters,
and unknown variant drafters are refused by name."""

from __future__ import annotations

import dataclasses
import json

import pytest

from mmspec.bench.vlm import VLMBenchConfig, run
from mmspec.cli import main


def test_bench_vlm_variants(tmp_path):
    cfg = VLMBenchConfig(num_scenes=2, batch_sizes=(2,), drafters=("vispec",), tasks=("caption",), max_new_tokens=8,
                         repeats=1, warmup_scenes=1, threads=1, verify_widths=(1, 4), tree=(3, 2, 4),
                         tree_drafters=("vispec",), auto_drafters=("vispec",), auto_max_draft_tokens=3,
                         draft_lengths=(2, 5))
    seen = []
    report = run(cfg, checkpoint=lambda r: seen.append(len(r["runs"])))
    assert seen == [1]  # called once the (one) task and batch size has its rows
    (rows,) = [r["methods"] for r in report["runs"]]
    # the bundled ViSpec drafter is saved with K = 5: that chain is row "vispec", not repeated
    assert report["model"]["num_draft_tokens"]["vispec"] == 5
    assert list(rows) == ["plain", "generate", "vispec", "vispec+tree", "vispec+auto", "vispec+k2"]
    assert report["model"]["num_draft_tokens"]["vispec+k2"] == 2 and report["model"]["trees"]["vispec+k2"] is None
    # a chain of 2 drafts at most 2 tokens per target forward: at most 3 tokens per forward, bonus included
    assert 1.0 < rows["vispec+k2"]["mean_accepted_length"] <= 3.0
    # transformers' own generate (the peer row) answers exactly like mmspec's plain decoding
    assert all(r["identical_to_plain"] for r in rows.values())
    assert rows["plain"]["mean_accepted_length"] == 1.0 == rows["generate"]["mean_accepted_length"]
    assert rows["generate"]["speedup_vs_generate"] == 1.0 and rows["plain"]["speedup_vs_generate"] > 0
    assert report["model"]["num_draft_tokens"]["vispec+auto"] == "auto"
    assert report["model"]["trees"]["vispec+tree"] == [3, 2, 4]
    json.dumps(report)  # the report is JSON as written by --json


def test_bench_vlm_refuses_unknown_variant_drafters():
    with pytest.raises(SystemExit, match="auto drafters \\['nope'\\]"):
        main(["bench", "vlm", "--num-scenes", "1", "--drafters", "vispec", "--auto-drafters", "nope"])
    with pytest.raises(SystemExit, match="length drafters \\['nope'\\]"):
        main(["bench", "vlm", "--num-scenes", "1", "--drafters", "vispec", "--draft-lengths", "3",
              "--length-drafters", "nope"])
    with pytest.raises(SystemExit, match="draft_lengths must be ints >= 1"):
        main(["bench", "vlm", "--num-scenes", "1", "--draft-lengths", "0,3"])
    with pytest.raises(SystemExit, match="draft_lengths lists an entry twice"):
        main(["bench", "vlm", "--num-scenes", "1", "--draft-lengths", "8,8"])
    with pytest.raises(SystemExit, match="auto_drafters lists an entry twice"):
        main(["bench", "vlm", "--num-scenes", "1", "--auto-drafters", "vispec,vispec"])
    with pytest.raises(SystemExit, match="length_drafters .* without draft_lengths"):
        main(["bench", "vlm", "--num-scenes", "1", "--length-drafters", "vispec"])
    with pytest.raises(SystemExit, match="tree_drafters .* without tree"):
        main(["bench", "vlm", "--num-scenes", "1", "--tree-drafters", "vispec"])
    with pytest.raises(SystemExit, match="exceeds"):
        main(["bench", "vlm", "--num-scenes", "1", "--tree", "2,2,9"])


def test_bench_vlm_tree_of_measured_size(tmp_path):
    """--tree DEPTH,TOP_K,auto: the saved drafter drafting trees whose size is chosen per request."""
    cfg = VLMBenchConfig(num_scenes=2, batch_sizes=(1,), drafters=("eagle",), tasks=("caption",), max_new_tokens=8,
                         repeats=1, warmup_scenes=1, threads=1, verify_widths=(1, 4), tree=(3, 2, "auto"),
                         generate=False)
    report = run(cfg)
    (rows,) = [r["methods"] for r in report["runs"]]
    assert list(rows) == ["plain", "eagle", "eagle+tree"]
    assert all(r["identical_to_plain"] for r in rows.values())
    assert report["model"]["trees"]["eagle+tree"] == [3, 2, "auto"]
    chosen = rows["eagle+tree"]["drafted_per_step"]  # node counts the bandit picked: a tree's choices
    assert sum(chosen.values()) > 0 and set(chosen) <= {0, 2, 4, 8, 10} and "drafted_per_step" not in rows["eagle"]


def test_bench_vlm_device_option():
    """`--device`: cuda without a GPU is refused by name; the report names the device; moving the
    pipeline (`pipe.to`) rebuilds the target's wrap and the built drafters for the new place and
    the answers stay the same (on CPU here; the CUDA run is benchmarks/gpu_check.sh's)."""
    import torch

    from mmspec.bench.vlm import DEFAULT_MODEL, load_pipeline

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            VLMBenchConfig(device="cuda")
    with pytest.raises(ValueError, match="acceptance='bogus' is not a known rule"):  # before the weights load
        VLMBenchConfig(acceptance="bogus")
    pipe = load_pipeline(DEFAULT_MODEL)
    from mmspec.testbed.vlm_eval import scene_size
    from mmspec.testbed.world import World

    scenes = World(seed=0, split="validation", image_size=scene_size(pipe.processor)).sample(2)
    images = [s.image for s in scenes]
    before = pipe(images, max_new_tokens=8).texts
    wrap = pipe._spec_target
    assert pipe.to("cpu") is pipe and pipe._spec_target is not wrap and not pipe._built
    assert pipe(images, max_new_tokens=8).texts == before
    pipe.to(torch.float64)  # a dtype move re-wraps too: the loop runs in the target's new dtype
    assert pipe._spec_target.spec.dtype == torch.float64
    spec = pipe(images, max_new_tokens=8)
    assert spec.texts == pipe(images, max_new_tokens=8, speculative=False).texts and spec.stats.mean_accepted_length > 1
    cfg = VLMBenchConfig(num_scenes=1, batch_sizes=(1,), drafters=("vispec",), tasks=("caption",), max_new_tokens=4,
                         repeats=1, warmup_scenes=1, threads=1, verify_widths=(1, 2), generate=False, device="cpu")
    assert run(cfg)["model"]["device"] == "cpu"


def test_bench_vlm_sampled_with_invariant_acceptance():
    """--temperature 0.8 --acceptance invariant: sampled answers, every row identical to plain
    sampling for the seeds (chains and trees); other rules and the generate peer are refused."""
    cfg = VLMBenchConfig(num_scenes=3, batch_sizes=(2,), drafters=("vispec",), tasks=("caption",), max_new_tokens=10,
                         repeats=1, warmup_scenes=1, threads=1, verify_widths=(1, 4), tree=(3, 2, 6),
                         generate=False, temperature=0.8, acceptance="invariant")
    report = run(cfg)
    (rows,) = [r["methods"] for r in report["runs"]]
    assert list(rows) == ["plain", "vispec", "vispec+tree"]
    assert all(r["identical_to_plain"] for r in rows.values())
    greedy = run(dataclasses.replace(cfg, temperature=0.0, tree=None))
    assert greedy["runs"][0]["sample"] != report["runs"][0]["sample"]  # sampled, not greedy, answers
    with pytest.raises(ValueError, match="acceptance='invariant' only"):
        VLMBenchConfig(temperature=0.8, generate=False)
    with pytest.raises(ValueError, match="--no-generate"):
        VLMBenchConfig(temperature=0.8, acceptance="invariant")


def test_demo_says_which_drafters_differ_instead_of_claiming_identical(monkeypatch):
    """The caption section printed "speculative ones are identical" whatever its own table said."""
    from mmspec.bench import vlm

    real = vlm.run_round

    def one_drafter_differs(pipe, methods, images, prompts, B, cfg):
        acc = real(pipe, methods, images, prompts, B, cfg)
        acc["eagle"]["seqs"][0] = acc["eagle"]["seqs"][0][:-1] + [acc["eagle"]["seqs"][0][-1] + 1]
        return acc

    text = vlm.demo(scenes=1, batch_sizes=(1,), max_new_tokens=4, threads=1)
    assert "speculative ones are identical" in text and "NO" not in text
    monkeypatch.setattr(vlm, "run_round", one_drafter_differs)
    text = vlm.demo(scenes=1, batch_sizes=(1,), max_new_tokens=4, threads=1)
    assert "those of eagle DIFFER" in text and "speculative ones are identical" not in text
