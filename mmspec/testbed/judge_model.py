"""The judge: a small CNN trained on the testbed world, used only as a measuring instrument.

What: a 4-stage strided CNN over 64x64 RGB images with three heads (main-object class =
shape x colour, number of objects, background kind). `Judge.score(images, class_labels)`
returns the class accuracy of generated images against the labels they were asked for, and
a Frechet distance between the judge's penultimate features of those images and of
held-out real world images (reference mean / covariance stored with the judge) — the FID
recipe (Heusel et al. 2017) with a world-specific feature extractor instead of Inception.

Why: lossy acceptance rules (LANTERN, GSD) trade image quality for speed; every speed-up
they report comes with a quality figure measured by this judge on the same images.

Limits: a toy instrument. Frechet distances are comparable only between image sets of
similar size (small sets bias the covariance), and only for this world.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import asdict, dataclass


import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from mmspec.assets_dir import ASSETS


# The bundled judge (a path that does not depend on the working directory).
JUDGE_DIR = ASSETS / "testbed" / "judge"


@dataclass(frozen=True)
class JudgeConfig:
    num_classes: int = 32
    num_counts: int = 3  # 1..3 objects
    num_backgrounds: int = 5
    width: int = 16
    feature_dim: int = 128
    image_size: int = 64

    def __post_init__(self) -> None:
        for name in ("num_classes", "num_counts", "num_backgrounds", "width", "feature_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"JudgeConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.image_size % 16:
            raise ValueError(f"JudgeConfig.image_size must be divisible by 16, got {self.image_size}")


@dataclass(frozen=True)
class JudgeTrainConfig:
    train_scenes: int = 10000
    val_scenes: int = 2000
    steps: int = 1200
    batch_size: int = 64
    lr: float = 2e-3
    seed: int = 0
    threads: int = 1

    def __post_init__(self) -> None:
        for name in ("train_scenes", "val_scenes", "steps", "batch_size", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"JudgeTrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not (math.isfinite(self.lr) and self.lr > 0):  # inf trained, then a raw LinAlgError
            raise ValueError(f"JudgeTrainConfig.lr must be a finite number > 0, got {self.lr}")
        if self.val_scenes < 2:  # found after training: the Frechet reference needs a covariance
            raise ValueError(f"JudgeTrainConfig.val_scenes must be >= 2, got {self.val_scenes}")


class Judge(nn.Module):
    """CNN classifier + feature extractor. Inputs: [B, 3, H, W] in [-1, 1] or PIL images."""

    def __init__(self, config: JudgeConfig = JudgeConfig()):
        super().__init__()
        self.config = config
        w = config.width
        chans = [3, w, 2 * w, 4 * w, 4 * w]
        layers = []
        for cin, cout in zip(chans[:-1], chans[1:]):
            layers += [nn.Conv2d(cin, cout, 3, stride=2, padding=1), nn.BatchNorm2d(cout), nn.SiLU(),
                       nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.SiLU()]
        self.backbone = nn.Sequential(*layers)
        self.proj = nn.Linear(chans[-1], config.feature_dim)
        self.class_head = nn.Linear(config.feature_dim, config.num_classes)
        self.count_head = nn.Linear(config.feature_dim, config.num_counts)
        self.background_head = nn.Linear(config.feature_dim, config.num_backgrounds)
        self.register_buffer("ref_mean", torch.zeros(config.feature_dim, dtype=torch.float64))
        self.register_buffer("ref_cov", torch.eye(config.feature_dim, dtype=torch.float64))

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] in [-1, 1] -> penultimate features [B, feature_dim]."""
        return F.silu(self.proj(self.backbone(pixels).mean((2, 3))))

    def forward(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        f = self.features(pixels)
        return {"features": f, "class": self.class_head(f), "count": self.count_head(f),
                "background": self.background_head(f)}

    # ---- measuring -------------------------------------------------------------------------
    @torch.no_grad()
    def score(self, images, class_labels) -> dict[str, float]:
        """Class accuracy against `class_labels` and Frechet distance to the real reference, for
        testbed-world images of the judge's size and classes (anything else is refused: a label out
        of range scored as a miss, another image size or a NaN pixel gave figures or a raw error)."""
        pixels = to_pixels(images)
        labels = torch.as_tensor(class_labels)
        if labels.shape != (pixels.shape[0],):
            raise ValueError(f"class_labels must have one label per image ({pixels.shape[0]}), got {tuple(labels.shape)}")
        c = self.config
        if labels.is_floating_point() or labels.dtype == torch.bool or (
                labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= c.num_classes)):
            raise ValueError(f"class_labels must be integer class ids in [0, {c.num_classes}) (the judge's classes), "
                             f"got {labels.tolist()[:8]}{' ...' if labels.numel() > 8 else ''}")
        labels = labels.long()
        if tuple(pixels.shape[2:]) != (c.image_size, c.image_size):
            raise ValueError(f"the judge scores {c.image_size}x{c.image_size} testbed images, got "
                             f"{pixels.shape[3]}x{pixels.shape[2]}; resize them or use a judge trained at that size")
        if not bool(torch.isfinite(pixels).all()):
            raise ValueError("images hold NaN or inf pixels: the generator's output is broken")
        if pixels.shape[0] < 2:
            raise ValueError("images must hold at least 2 images (a covariance needs two)")
        self.eval()
        feats, preds = [], []
        for chunk in pixels.split(256):
            out = self(chunk)
            feats.append(out["features"].double())
            preds.append(out["class"].argmax(-1))
        feats = torch.cat(feats)
        acc = float((torch.cat(preds) == labels).double().mean())
        return {"accuracy": acc, "frechet": frechet_distance(feats.mean(0), torch.cov(feats.T), self.ref_mean, self.ref_cov)}

    # ---- persistence -----------------------------------------------------------------------
    def save_pretrained(self, directory: str, metrics: dict | None = None) -> None:
        from safetensors.torch import save_file

        os.makedirs(directory, exist_ok=True)
        state = {k: (v.half() if v.is_floating_point() and not k.startswith("ref_") else v).contiguous()
                 for k, v in self.state_dict().items()}
        save_file(state, os.path.join(directory, "model.safetensors"))
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(asdict(self.config), f, indent=2)
        if metrics is not None:
            with open(os.path.join(directory, "metrics.json"), "w") as f:
                json.dump(metrics, f, indent=2)

    @classmethod
    def from_pretrained(cls, directory: str) -> "Judge":
        from safetensors.torch import load_file

        cfg_path = os.path.join(directory, "config.json")
        if not os.path.isfile(cfg_path):
            raise ValueError(f"directory={directory!r} holds no judge (config.json missing); train one with "
                             "`mmspec testbed train-judge`")
        with open(cfg_path) as f:
            fields = json.load(f)
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(JudgeConfig)})
        if unknown:  # another model's folder (a VQ's, a pipeline's): a TypeError from the dataclass before
            raise ValueError(f"directory={directory!r} holds no judge: its config.json has fields {unknown[:6]} a "
                             "JudgeConfig does not (another model's folder?)")
        judge = cls(JudgeConfig(**fields))
        state = load_file(os.path.join(directory, "model.safetensors"))
        judge.load_state_dict({k: v.to(judge.state_dict()[k].dtype) for k, v in state.items()})
        return judge.eval()


def check_judge_fits(judge_dir, num_classes: int, image_size: int, what: str, drop: str) -> None:
    """Refuse (ValueError) a generator the judge in `judge_dir` cannot score: it scores testbed
    images of its own size and classes. `what` names the generator, `drop` the option to drop."""
    c = Judge.from_pretrained(str(judge_dir)).config
    if num_classes != c.num_classes or image_size != c.image_size:
        raise ValueError(f"judge {str(judge_dir)!r} scores {c.image_size}x{c.image_size} testbed images of "
                         f"{c.num_classes} classes; {what} makes {image_size}x{image_size} images of {num_classes} "
                         f"classes ({drop})")


def to_pixels(images) -> torch.Tensor:
    """PIL images or a [B, 3, H, W] tensor in [-1, 1] -> float32 tensor [B, 3, H, W]."""
    if isinstance(images, torch.Tensor):
        if images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(f"images must be [B, 3, H, W], got {tuple(images.shape)}")
        return images.float()
    arrays = [np.asarray(im.convert("RGB"), dtype=np.float32) for im in images]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2) / 127.5 - 1.0


def frechet_distance(mu1: torch.Tensor, cov1: torch.Tensor, mu2: torch.Tensor, cov2: torch.Tensor) -> float:
    """||mu1 - mu2||^2 + Tr(C1 + C2 - 2 (C1 C2)^{1/2}), in float64.
    Tr((C1 C2)^{1/2}) = sum sqrt(eig(S C2 S)) with S = C1^{1/2} (both symmetric PSD)."""
    mu1, mu2, cov1, cov2 = (t.double() for t in (mu1, mu2, cov1, cov2))
    evals, evecs = torch.linalg.eigh(cov1)
    s = evecs @ torch.diag(evals.clamp_min(0).sqrt()) @ evecs.T
    cross = torch.linalg.eigvalsh(s @ cov2 @ s).clamp_min(0).sqrt().sum()
    return float(((mu1 - mu2) ** 2).sum() + torch.trace(cov1) + torch.trace(cov2) - 2 * cross)


def _scene_arrays(split: str, n: int, seed: int):
    from mmspec.testbed.world import BACKGROUNDS, World

    scenes = World(seed=seed, split=split).sample(n)
    pixels = to_pixels([s.image for s in scenes])
    cls = torch.tensor([s.class_label for s in scenes])
    count = torch.tensor([len(s.attributes["objects"]) - 1 for s in scenes])
    bg = torch.tensor([BACKGROUNDS.index(s.attributes["background"]["kind"]) for s in scenes])
    return pixels, cls, count, bg


def train_judge(config: JudgeTrainConfig, out_dir: str | None = None, progress: bool = True) -> tuple[Judge, dict]:
    """Train on the world's train split; reference statistics from its validation split."""
    from tqdm import tqdm

    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    t0 = time.perf_counter()
    x, y, yc, yb = _scene_arrays("train", config.train_scenes, seed=0)
    xv, yv, _, _ = _scene_arrays("validation", config.val_scenes, seed=0)
    judge = Judge()
    opt = torch.optim.AdamW(judge.parameters(), lr=config.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=config.lr, total_steps=config.steps)
    g = torch.Generator().manual_seed(config.seed)
    bar = tqdm(range(config.steps), desc="train-judge", disable=not progress)
    for _ in bar:
        idx = torch.randint(0, x.shape[0], (config.batch_size,), generator=g)
        out = judge(x[idx])
        loss = (F.cross_entropy(out["class"], y[idx]) + 0.3 * F.cross_entropy(out["count"], yc[idx])
                + 0.3 * F.cross_entropy(out["background"], yb[idx]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    judge.eval()
    with torch.no_grad():
        feats = torch.cat([judge.features(c).double() for c in xv.split(256)])
        judge.ref_mean.copy_(feats.mean(0))
        judge.ref_cov.copy_(torch.cov(feats.T))
    # Validation accuracy on scenes the judge never saw (a second, disjoint validation block).
    xt, yt, _, _ = _scene_arrays("test", 1000, seed=0)
    metrics = {
        "val_class_accuracy": judge.score(xv, yv)["accuracy"],
        "test_class_accuracy": judge.score(xt, yt)["accuracy"],
        "frechet_test_vs_reference": judge.score(xt, yt)["frechet"],
        "train_seconds": round(time.perf_counter() - t0, 1),
        "config": asdict(config),
    }
    if out_dir is not None:
        judge.save_pretrained(out_dir, metrics)
    return judge, metrics
