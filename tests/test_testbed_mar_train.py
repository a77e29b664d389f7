"""`mmspec testbed train-mar` in stages on a tiny config: each stage saves its result under
--work so later stages run in a separate invocation, the eval stage writes a loadable fp16
SpeculativeMARPipeline folder with metrics.json (the sampling defaults `mmspec generate` reads)
and the stage logs; bad stage names and configs are refused."""

from __future__ import annotations

import json

import pytest
import torch

from mmspec.cli import main
from mmspec.testbed.mar_train import MARTrainConfig

TINY = ["--threads", "1", "--n-train", "16", "--vae-steps", "2", "--vae-full-steps", "1", "--mar-steps", "2",
        "--draft-steps", "1", "--mar-batch", "4", "--n-eval", "4", "--eval-num-iter", "2",
        "--eval-temperature", "0.6"]


def test_stages_in_separate_invocations(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    assert main(["testbed", "train-mar", "--out", str(out), "--work", str(work), "--stages", "vae", *TINY]) == 0
    record = json.loads((work / "metrics.json").read_text())
    assert set(record) == {"vae"} and not out.exists()
    assert (work / "vae" / "config.json").is_file() and (work / "latents.pt").is_file()
    lat = torch.load(work / "latents.pt")
    assert lat["latents"].shape == (16, 8, 8, 8) and lat["labels"].shape == (16,)  # stride 8: an 8 x 8 grid
    assert abs(float(lat["latents"].std()) - 1.0) < 1e-4  # scaled to unit std by scaling_factor
    assert "judge_vae_recon" in record["vae"] and "vae_psnr_db" in record["vae"]
    steps = [json.loads(x) for x in (work / "vae_log.jsonl").read_text().splitlines()]
    assert [s["size"] for s in steps if s.get("phase") == "vae"] == [32, 64]  # a crop step, then a whole scene

    assert main(["testbed", "train-mar", "--out", str(out), "--work", str(work), "--stages", "target,drafter,eval",
                 *TINY]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics["stage_seconds"]) == {"vae", "target", "drafter", "eval"}
    assert metrics["config"]["eval_num_iter"] == 2 and "judge_vae_recon" in metrics
    for name in ("plain", "speculative"):
        assert {"accuracy", "frechet", "colour_accuracy", "shape_accuracy", "acceptance_rate"} <= set(metrics[name])
    assert metrics["plain"]["draft_calls"] == 0 and metrics["speculative"]["draft_calls"] > 0
    for s in ("vae", "target", "drafter", "eval"):
        assert (out / f"train_log_{s}.jsonl").is_file()
    assert (out / "contact_sheet.png").is_file()

    from mmspec.pipelines import SpeculativeMARPipeline
    from mmspec.pipelines.mar_cli import mar_defaults

    pipe = SpeculativeMARPipeline.from_pretrained(str(out))
    assert pipe.drafter is not None
    from safetensors.torch import load_file

    for comp in ("transformer", "drafter", "vae"):  # bundled fp16
        weights = load_file(str(next((out / comp).glob("*.safetensors"))))
        assert {t.dtype for t in weights.values()} == {torch.float16}, comp
    assert mar_defaults(out, pipe)["num_iter"] == 2
    assert mar_defaults(out, pipe)["temperature"] == 0.6  # the folder's sampling temperature
    assert metrics["config"]["main_position"] == "centre"

    # a stage run on its own is reproducible: its initial weights are seeded (they were not)
    import shutil

    from safetensors.torch import load_file as load

    again = tmp_path / "again"
    shutil.copytree(work, again)
    assert main(["testbed", "train-mar", "--out", str(tmp_path / "out2"), "--work", str(again), "--stages", "drafter",
                 *TINY]) == 0
    first, second = (load(str(next((w / "drafter").glob("*.safetensors")))) for w in (work, again))
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_bad_stage_and_config_refused(tmp_path):
    with pytest.raises(SystemExit, match="unknown stages.*'bogus'"):
        main(["testbed", "train-mar", "--out", str(tmp_path / "o"), "--stages", "vae,bogus"])
    with pytest.raises(SystemExit, match="vae_full_steps"):
        main(["testbed", "train-mar", "--out", str(tmp_path / "o"), "--vae-steps", "5", "--vae-full-steps", "9"])
    with pytest.raises(ValueError, match="vae_crop"):
        MARTrainConfig(vae_crop=20)
    with pytest.raises(ValueError, match="eval_temperature"):
        MARTrainConfig(eval_temperature=0.0)
    with pytest.raises(ValueError, match="main_position"):
        MARTrainConfig(main_position="corner")
    # Refused before the VAE stage trains: these failed (or trained backwards) only at a later stage.
    for kwargs, message in ((dict(target_dim=0), "target_dim must be >= 1"), (dict(draft_depth=0), "draft_depth must be >= 1"),
                            (dict(target_dim=6), "encoder_embed_dim=6 must be divisible"),
                            (dict(mar_lr=-1e-3), "mar_lr must be a finite number > 0"),
                            (dict(vae_lr=float("nan")), "vae_lr must be a finite number > 0"),
                            # checked only at the eval stage, after every training stage (or never)
                            (dict(eval_num_iter=0), r"eval_num_iter: num_iter must be an int in \[1, 64\]"),
                            (dict(eval_num_iter=1000), "eval_num_iter"),
                            (dict(eval_guidance=float("nan")), "eval_guidance must be a finite number"),
                            (dict(eval_temperature=float("inf")), "eval_temperature must be a finite number > 0"),
                            (dict(vae_kl=-1.0), "vae_kl must be a finite number >= 0"),
                            (dict(buffer_size=-1), "buffer_size must be >= 0")):
        with pytest.raises(ValueError, match=message):
            MARTrainConfig(**kwargs)
    with pytest.raises(SystemExit, match="target_dim must be >= 1"):
        main(["testbed", "train-mar", "--out", str(tmp_path / "o2"), "--target-dim", "0"])
    assert not (tmp_path / "o2").exists()


def test_mask_ratio_min_reaches_the_model_and_is_checked(tmp_path):
    from mmspec.testbed.mar_train import make_mar

    c = MARTrainConfig(mask_ratio_min=0.5)
    assert make_mar(c, 32, 1, (1, 32)).config.mask_ratio_min == 0.5
    with pytest.raises(SystemExit, match="mask_ratio_min"):
        main(["testbed", "train-mar", "--out", str(tmp_path / "o"), "--mask-ratio-min", "1.0"])
