"""The judge: Frechet arithmetic, persistence, and the bundled judge as a measuring instrument."""

from __future__ import annotations

import os

import pytest
import torch

from mmspec.testbed.judge_model import Judge, JudgeConfig, frechet_distance, to_pixels
from mmspec.testbed.world import World

ASSET = os.path.join(os.path.dirname(__file__), "..", "assets", "testbed", "judge")


def test_frechet_distance_matches_the_closed_form_for_diagonal_covariances():
    g = torch.Generator().manual_seed(0)
    mu1, mu2 = torch.randn(6, generator=g, dtype=torch.float64), torch.randn(6, generator=g, dtype=torch.float64)
    v1, v2 = torch.rand(6, generator=g, dtype=torch.float64) + 0.1, torch.rand(6, generator=g, dtype=torch.float64) + 0.1
    expected = ((mu1 - mu2) ** 2).sum() + ((v1.sqrt() - v2.sqrt()) ** 2).sum()
    got = frechet_distance(mu1, torch.diag(v1), mu2, torch.diag(v2))
    assert got == pytest.approx(float(expected), rel=1e-9, abs=1e-9)
    a = torch.randn(8, 8, generator=g, dtype=torch.float64)
    cov = a @ a.T
    assert frechet_distance(mu1[:1].expand(8), cov, mu1[:1].expand(8), cov) == pytest.approx(0.0, abs=1e-8)


def test_save_and_load_round_trip(tmp_path):
    torch.manual_seed(0)
    judge = Judge(JudgeConfig(width=8, feature_dim=16)).eval()
    judge.save_pretrained(str(tmp_path))
    again = Judge.from_pretrained(str(tmp_path))
    x = torch.rand(3, 3, 64, 64) * 2 - 1
    # fp16 storage: features agree to fp16 precision
    torch.testing.assert_close(again.features(x), judge.features(x), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="directory"):
        Judge.from_pretrained(str(tmp_path / "nothing"))


def test_bad_inputs_name_the_argument():
    judge = Judge(JudgeConfig(width=8, feature_dim=16))
    with pytest.raises(ValueError, match="class_labels"):
        judge.score(torch.zeros(4, 3, 64, 64), [0, 1])
    with pytest.raises(ValueError, match="images"):
        judge.score(torch.zeros(4, 64, 64), [0, 1, 2, 3])
    # Were scored: labels out of range (counted as misses) or truncated floats, other image sizes;
    # a NaN pixel ended in a raw LinAlgError.
    ok = torch.zeros(4, 3, 64, 64)
    for labels in ([0, 1, 2, 32], [0, 1, 2, -1], [0.0, 1.5, 2.0, 3.0]):
        with pytest.raises(ValueError, match=r"class_labels must be integer class ids in \[0, 32\)"):
            judge.score(ok, labels)
    for size in (32, 128):
        with pytest.raises(ValueError, match=f"scores 64x64 testbed images, got {size}x{size}"):
            judge.score(torch.zeros(4, 3, size, size), [0, 1, 2, 3])
    bad = ok.clone()
    bad[1, 0, 3, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf pixels"):
        judge.score(bad, [0, 1, 2, 3])
    assert set(judge.score(ok, torch.tensor([0, 1, 2, 3], dtype=torch.int32))) == {"accuracy", "frechet"}
    with pytest.raises(ValueError, match="width"):
        JudgeConfig(width=0)
    from mmspec.testbed.judge_model import JudgeTrainConfig

    # found after training: --val-scenes 1 ("at least 2 images"), --lr inf (a raw LinAlgError)
    for kwargs, message in ((dict(val_scenes=1), "val_scenes must be >= 2"), (dict(lr=float("inf")), "lr must be a finite"),
                            (dict(lr=float("nan")), "lr must be a finite")):
        with pytest.raises(ValueError, match=message):
            JudgeTrainConfig(**kwargs)


@pytest.fixture(scope="module")
def bundled():
    return Judge.from_pretrained(ASSET)


@pytest.fixture(scope="module")
def held_out():
    scenes = World(seed=0, split="test").sample(300, start=1000)  # beyond the 1000 used for its metrics
    return to_pixels([s.image for s in scenes]), [s.class_label for s in scenes]


def test_bundled_judge_classifies_held_out_scenes(bundled, held_out):
    pixels, labels = held_out
    # Measured 99.6% on 1000 test scenes at training time; 300 fresh scenes, margin for sampling noise.
    assert bundled.score(pixels, labels)["accuracy"] >= 0.95


def test_bundled_judge_frechet_separates_real_from_degraded(bundled, held_out):
    pixels, labels = held_out
    real = bundled.score(pixels, labels)
    blurred = torch.nn.functional.avg_pool2d(pixels, 4).repeat_interleave(4, 2).repeat_interleave(4, 3)
    noisy = (pixels + 0.5 * torch.randn(pixels.shape, generator=torch.Generator().manual_seed(0))).clamp(-1, 1)
    wrong = bundled.score(pixels, [(l + 1) % 32 for l in labels])
    assert wrong["accuracy"] < 0.1
    for degraded in (blurred, noisy):
        d = bundled.score(degraded, labels)
        assert d["frechet"] > 3 * real["frechet"]


def test_another_models_folder_is_not_taken_for_a_judge():
    """A VQ folder gave a TypeError from JudgeConfig (unexpected keyword 'codebook_size')."""
    from pathlib import Path

    import pytest

    from mmspec.testbed.judge_model import Judge

    vq = Path(__file__).resolve().parents[1] / "assets" / "testbed" / "vq"
    with pytest.raises(ValueError, match="holds no judge: its config.json has fields .*'codebook_size'"):
        Judge.from_pretrained(str(vq))
