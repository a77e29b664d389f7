"""`mmspec bench vlm` on the bundled testbed VLM, tiny settings: every method's answers equal
plain decoding, the tree and adaptive-length variants are registered from the saved drafters,
and unknown variant drafters are refused by name."""

from __future__ import annotations

import json

import pytest

from mmspec.bench.vlm import VLMBenchConfig, run
from mmspec.cli import main


def test_bench_vlm_variants(tmp_path):
    cfg = VLMBenchConfig(num_scenes=2, batch_sizes=(2,), drafters=("vispec",), tasks=("caption",), max_new_tokens=8,
                         repeats=1, warmup_scenes=1, threads=1, verify_widths=(1, 4), tree=(3, 2, 4),
                         tree_drafters=("vispec",), auto_drafters=("vispec",), auto_max_draft_tokens=3,
                         draft_lengths=(2, 5))
    report = run(cfg)
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
