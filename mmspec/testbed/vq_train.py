"""Train and evaluate the testbed's small LlamaGen-architecture VQ tokenizer on CPU.

What: 64x64 procedural-world images (``mmspec.testbed.world``) -> 16x16 token maps
(downsampling 4) with the LlamaGen VQ architecture (``mmspec.models.llamagen_tokenizer``;
Sun et al. 2024, github.com/FoundationVision/LlamaGen). Loss = pixel MSE + codebook (VQ)
loss + commitment loss (van den Oord et al. 2017); no LPIPS / GAN terms, which the world's
flat-coloured scenes do not need. Dead codes are restarted from recent encoder outputs
(as in Jukebox / "SoundStream" codebook resets) so that codebook usage stays high.

Compute budget: one CPU thread for about a quarter of an hour. To afford enough updates,
most steps see random 32x32 crops (the network is convolutional; the attention blocks at
the lowest resolution see 8x8 instead of 16x16 tokens) and the last ``full_res_frac`` of
the steps see whole 64x64 images so the attention adapts to the full token grid.

Limits: a toy tokenizer for a toy world; numbers hold for World(seed=0) scenes only.
Run: ``python -m mmspec.testbed.vq_train train-vq --out assets/testbed/vq``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from mmspec.assets_dir import ASSETS
from mmspec.cli_types import positive_int
from mmspec.models.llamagen_tokenizer import LlamaGenVQ, VQConfig

# Two codes are "decoded twins" when, placed at the same token of the same contexts, their
# decoded patches differ by an MSE (pixels on [0, 1]) below this: 1e-4 is 40 dB, an RMS
# difference of 2.5/255, i.e. near-identical.
TWIN_MSE = 1e-4


@dataclasses.dataclass(frozen=True)
class VQTrainConfig:
    """Training recipe; every field maps 1:1 to a CLI option where one exists."""

    steps: int = 1500
    batch_size: int = 16
    seed: int = 0
    threads: int = 1
    lr: float = 2e-3
    warmup: int = 100
    crop: int = 32  # training crop side for the first (1 - full_res_frac) of the steps
    full_res_frac: float = 0.25
    n_train_scenes: int = 8000  # pre-rendered once (~4 ms each)
    n_val: int = 256
    restart_every: int = 20  # steps between dead-code restarts (0 disables)
    image_size: int = 64
    codebook_size: int = 512
    codebook_embed_dim: int = 8
    ch: int = 32
    ch_mult: tuple[int, ...] = (1, 1, 2)
    z_channels: int = 64
    num_res_blocks: int = 1
    commit_loss_beta: float = 0.25

    def __post_init__(self):
        for name in ("steps", "batch_size", "threads", "n_train_scenes", "n_val", "crop"):
            if getattr(self, name) < 1:
                raise ValueError(f"VQTrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.full_res_frac <= 1.0:
            raise ValueError(f"VQTrainConfig.full_res_frac must be in [0, 1], got {self.full_res_frac}")
        if self.crop > self.image_size or self.crop % 2 ** (len(self.ch_mult) - 1):
            raise ValueError(f"VQTrainConfig.crop={self.crop} must be <= image_size and divisible by the "
                             "downsampling factor of ch_mult")
        self.vq_config()  # validates the architecture fields

    def vq_config(self) -> VQConfig:
        return VQConfig(codebook_size=self.codebook_size, codebook_embed_dim=self.codebook_embed_dim, ch=self.ch,
                        ch_mult=self.ch_mult, z_channels=self.z_channels, num_res_blocks=self.num_res_blocks,
                        commit_loss_beta=self.commit_loss_beta, codebook_show_usage=False,
                        image_size=self.image_size)


def render(split: str, n: int, image_size: int = 64, seed: int = 0, start: int = 0) -> torch.Tensor:
    """World scenes [start, start+n) of `split` as uint8 [n, 3, S, S] (deterministic)."""
    from mmspec.testbed.world import World

    scenes = World(seed=seed, image_size=image_size, split=split).sample(n, start=start)
    return torch.from_numpy(np.stack([np.asarray(s.image.convert("RGB")) for s in scenes])).permute(0, 3, 1, 2)


def to_pixels(images_u8: torch.Tensor) -> torch.Tensor:
    return images_u8.float().div(127.5).sub(1.0)


def psnr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-image PSNR in dB of pixels in [-1, 1] (computed on the [0, 1] scale): [B]."""
    mse = ((a - b) / 2).pow(2).flatten(1).mean(1).clamp_min(1e-10)
    return -10 * torch.log10(mse)


@torch.no_grad()
def restart_dead_codes(model: LlamaGenVQ, counts: torch.Tensor, latents: torch.Tensor,
                       generator: torch.Generator) -> int:
    """Re-initialise codes with zero `counts` from random rows of recent `latents` [N, D]
    plus small noise; returns how many were restarted."""
    dead = (counts == 0).nonzero().flatten()
    if dead.numel() == 0:
        return 0
    pick = torch.randint(0, latents.shape[0], (dead.numel(),), generator=generator)
    noise = 0.01 * torch.randn(dead.numel(), latents.shape[1], generator=generator)
    model.quantize.embedding.weight[dead] = latents[pick] + noise
    return int(dead.numel())


def train_vq(config: VQTrainConfig, out_dir: str | Path | None, progress: bool = True) -> dict:
    """Trains, evaluates on validation scenes, saves (if `out_dir`) and returns the metrics."""
    from tqdm import tqdm

    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    gen = torch.Generator().manual_seed(config.seed)
    t0 = time.time()
    data = render("train", config.n_train_scenes, config.image_size)
    render_s = time.time() - t0
    model = LlamaGenVQ(config.vq_config(), generator=gen).train()
    opt = torch.optim.Adam(model.parameters(), lr=config.lr, betas=(0.9, 0.99))
    full_from = int(round(config.steps * (1 - config.full_res_frac)))
    counts = torch.zeros(config.codebook_size, dtype=torch.long)
    restarts, log = 0, []
    bar = tqdm(range(config.steps), disable=not progress, desc="train-vq", file=sys.stderr)
    for step in bar:
        lr = config.lr * min(1.0, (step + 1) / config.warmup) * (0.55 + 0.45 * math.cos(math.pi * step / config.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        idx = torch.randint(0, data.shape[0], (config.batch_size,), generator=gen)
        x = to_pixels(data[idx])
        if torch.rand((), generator=gen) < 0.5:
            x = x.flip(3)  # horizontal flip: free augmentation for a tokenizer
        if step < full_from and config.crop < config.image_size:
            i, j = torch.randint(0, config.image_size - config.crop + 1, (2,), generator=gen).tolist()
            x = x[:, :, i:i + config.crop, j:j + config.crop]
        out = model(x)
        rec_loss = F.mse_loss(out.reconstruction, x)
        loss = rec_loss + out.vq_loss + out.commit_loss + out.entropy_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        loss = loss.detach()
        opt.step()
        counts += torch.bincount(out.codes.flatten(), minlength=config.codebook_size)
        if config.restart_every and (step + 1) % config.restart_every == 0 and step + 1 < config.steps * 0.9:
            restarts += restart_dead_codes(model, counts, out.latents.detach(), gen)
            counts.zero_()
        if step % 10 == 0:
            p = float(psnr(out.reconstruction.detach().clamp(-1, 1), x).mean())
            bar.set_postfix(loss=f"{loss.item():.4f}", psnr=f"{p:.1f}")
            log.append({"step": step, "loss": round(loss.item(), 5), "psnr": round(p, 2)})
    train_s = time.time() - t0
    model.eval()
    metrics = {"train_wall_s": round(train_s, 1), "render_s": round(render_s, 1), "steps": config.steps,
               "seed": config.seed, "restarted_codes": restarts, "train_config": dataclasses.asdict(config),
               **eval_vq(model, config.n_val)}
    if out_dir is not None:
        out_dir = Path(out_dir)
        model.save_pretrained(out_dir)
        (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        (out_dir / "train_log.json").write_text(json.dumps(log) + "\n")
    return metrics


@torch.no_grad()
def eval_vq(model: LlamaGenVQ, n_val: int = 256, batch_size: int = 64) -> dict:
    """Reconstruction and codebook metrics on the first `n_val` World(seed=0) validation scenes.

    - ``psnr_db``: mean per-image PSNR (pixels on the [0, 1] scale) of decode(encode(x)).
    - ``codebook_usage``: fraction of the V codes used at least once on those scenes.
    - ``nn_ratio_median``: for each code of the normalised codebook, the L2 distance to its
      nearest other code divided by the median pairwise distance over all codes; the median
      over codes. Small values mean many codes have close latent neighbours (LANTERN's premise).
    - Decoded twins: take the token maps of the first 4 validation scenes as contexts; for every
      code, write it into the centre token of each context, decode, and keep that token's own
      ds x ds pixel patch (on [0, 1]). The MSE between two codes' patches (averaged over the 4
      contexts) measures how alike they look in place. ``twin_pairs`` counts code pairs with
      MSE < ``TWIN_MSE`` = 1e-4 (> 40 dB: near-identical), ``twin_pair_fraction`` is that over
      all ordered pairs, ``codes_with_twin`` the codes having at least one twin;
      ``nn_patch_mse_median`` is the median of that MSE between each code and its latent
      nearest neighbour, ``pair_patch_mse_median`` the median over all pairs for scale.
    """
    cfg = model.config
    images = to_pixels(render("validation", n_val, cfg.image_size))
    psnrs, codes_all = [], []
    for k in range(0, n_val, batch_size):
        x = images[k:k + batch_size]
        codes = model.encode(x)
        psnrs.append(psnr(model.decode(codes), x))
        codes_all.append(codes)
    codes_all = torch.cat(codes_all)
    v = cfg.codebook_size
    usage = torch.bincount(codes_all.flatten(), minlength=v)

    table = model.codebook().float()
    dist = torch.cdist(table, table)  # [V, V]
    off = dist[~torch.eye(v, dtype=torch.bool)]
    nn_dist, nn_idx = dist.masked_fill(torch.eye(v, dtype=torch.bool), float("inf")).min(1)
    nn_ratio = nn_dist / off.median()

    patches = _context_patches(model, codes_all[:4], batch_size)  # [V, 4 * 3 * ds * ds]
    pair_mse = torch.cdist(patches, patches).pow(2) / patches.shape[1]
    twins = (pair_mse < TWIN_MSE) & ~torch.eye(v, dtype=torch.bool)
    psnrs = torch.cat(psnrs)
    return {"psnr_db": round(float(psnrs.mean()), 3), "psnr_db_min": round(float(psnrs.min()), 3),
            "codebook_usage": round(float((usage > 0).float().mean()), 4), "codes_used": int((usage > 0).sum()),
            "codebook_size": v, "n_val": n_val, "nn_ratio_median": round(float(nn_ratio.median()), 4),
            "nn_ratio_median_used": round(float(nn_ratio[usage > 0].median()), 4),
            "twin_pairs": int(twins.sum()) // 2, "twin_pair_fraction": round(float(twins.float().mean()), 4),
            "codes_with_twin": int(twins.any(1).sum()), "twin_mse": TWIN_MSE,
            "nn_patch_mse_median": float(f"{float(pair_mse[torch.arange(v), nn_idx].median()):.3g}"),
            "pair_patch_mse_median": float(f"{float(pair_mse[~torch.eye(v, dtype=torch.bool)].median()):.3g}")}


def _context_patches(model: LlamaGenVQ, contexts: torch.Tensor, batch_size: int) -> torch.Tensor:
    """For each code v: put v at the centre token of each context token map [K, h, w], decode,
    and keep that token's own ds x ds pixel patch (on [0, 1]); concatenated over contexts: [V, K*3*ds*ds]."""
    cfg = model.config
    v, ds = cfg.codebook_size, cfg.downsample
    r, c = contexts.shape[1] // 2, contexts.shape[2] // 2
    feats = []
    for ctx in contexts:
        out = []
        for k in range(0, v, batch_size):
            ids = torch.arange(k, min(v, k + batch_size))
            grid = ctx.expand(ids.numel(), -1, -1).clone()
            grid[:, r, c] = ids
            img = model.decode(grid)
            out.append(((img[:, :, r * ds:(r + 1) * ds, c * ds:(c + 1) * ds] + 1) / 2).flatten(1))
        feats.append(torch.cat(out))
    return torch.cat(feats, 1)


def add_vq_commands(subparsers) -> None:
    """Registers `train-vq` and `eval-vq` on an argparse subparsers object."""
    d = VQTrainConfig()
    p = subparsers.add_parser("train-vq", help="train the testbed VQ tokenizer on CPU")
    p.add_argument("--out", default="assets/testbed/vq", help="output folder")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=positive_int, default=d.threads)
    p.set_defaults(func=_cmd_train)
    e = subparsers.add_parser("eval-vq", help="evaluate a trained VQ tokenizer on validation scenes")
    e.add_argument("--model", default=str(ASSETS / "testbed" / "vq"),
                   help="folder written by train-vq (default: the bundled VQ)")
    e.add_argument("--n", type=int, default=d.n_val, help="number of validation scenes")
    e.set_defaults(func=_cmd_eval)


def _cmd_train(args) -> None:
    try:
        cfg = VQTrainConfig(steps=args.steps, batch_size=args.batch_size, seed=args.seed, threads=args.threads)
    except ValueError as e:
        raise SystemExit(f"mmspec testbed train-vq: {e}") from None
    metrics = train_vq(cfg, args.out)
    metrics["command"] = " ".join(["mmspec"] + sys.argv[1:])  # the command as typed (mmspec testbed train-vq ...)
    Path(args.out, "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(json.dumps({k: v for k, v in metrics.items() if k != "train_config"}, indent=2))


def _cmd_eval(args) -> None:
    if args.n < 1:
        raise SystemExit(f"mmspec testbed eval-vq: --n must be >= 1, got {args.n}")
    torch.set_num_threads(1)
    print(json.dumps(eval_vq(LlamaGenVQ.from_pretrained(args.model), args.n), indent=2))


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m mmspec.testbed.vq_train")
    add_vq_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
