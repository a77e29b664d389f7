"""Train the testbed's MAR pair on CPU: a small diffusers `AutoencoderKL`, a MAR target and a
smaller MAR drafter on its latents, for `SpeculativeMARPipeline`.

What: 64x64 procedural-world scenes (`mmspec.testbed.world`) restricted to ONE object on a
PLAIN background (32 classes = 4 shapes x 8 colours). Why this subset and grid: a CPU-trained
generator must get shape and colour right to be recognisable, and every extra object or
texture is capacity it does not have; the VAE downsamples by 16 (like MAR's KL-16) so an image
is a 4 x 4 grid of 8-dim tokens — 16 tokens, which a small MAR can order and a small head
can denoise in minutes, while the main object (diameter 22-36 px) still spans 2 tokens.

Recipe: VAE = pixel L1 + MSE + 1e-6 KL (latent-diffusion style, no GAN / LPIPS); latents
scaled to unit std (the factor is stored as `scaling_factor`, as MAR's 0.2325). MAR =
official loss (random order, truncated-Gaussian mask ratio, class dropout 0.1, diffusion loss
with the cosine schedule and learned variance). AdamW, cosine LR, fixed seeds, losses logged.

Limits: a toy for a toy world; numbers hold for World(seed=0) single-object scenes only.
Measured with these defaults before `clip_x0` existed (seed 0, 2 threads, 19.4 min of
training): VAE PSNR 21.7 dB, judge class accuracy 19.9% on VAE reconstructions (the 4 x 4
grid keeps colour and position but loses the shape), 2.3% on 256 plain samples (the head
diverged at t = 999), 12.9% with the x0 clamp applied to the same weights; chance is 3.1%.
Not recognisable: an 8 x 8 grid (stride 8) and longer runs (or `--device cuda`) are next.
Run: `mmspec testbed train-mar --out DIR` (see `add_mar_command`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import torch
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class MARTrainConfig:
    seed: int = 0
    threads: int = 2
    device: str = "cpu"
    n_train: int = 6000
    n_eval: int = 256
    vae_steps: int = 900
    vae_batch: int = 16
    vae_lr: float = 2e-3
    vae_kl: float = 1e-6
    vae_channels: tuple[int, ...] = (16, 32, 32, 64, 64)  # 4 downsamplings: 64 px -> 4 x 4
    latent_channels: int = 8
    mar_steps: int = 5000
    mar_batch: int = 64
    mar_lr: float = 1e-3
    target_dim: int = 128
    target_depth: int = 2
    target_head: tuple[int, int] = (2, 128)  # diffusion head depth, width
    draft_steps: int = 1500
    draft_dim: int = 64
    draft_depth: int = 1
    draft_head: tuple[int, int] = (2, 96)
    num_sampling_steps: int = 25
    clip_x0: float = 4.0  # clamp of the head's x0 estimate (latents have unit std); see mar_diffloss
    buffer_size: int = 8
    eval_num_iter: int = 8
    eval_guidance: float = 3.0

    def __post_init__(self):
        for name in ("n_train", "n_eval", "vae_steps", "vae_batch", "mar_steps", "mar_batch", "draft_steps", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"MARTrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_eval < 2:
            raise ValueError("MARTrainConfig.n_eval must be >= 2 (Frechet needs a covariance)")


def world_config():
    from mmspec.testbed.world import WorldConfig

    return WorldConfig(max_objects=1, backgrounds=("plain",))


def scenes(split: str, n: int, seed: int = 0):
    from mmspec.testbed.judge_model import to_pixels
    from mmspec.testbed.world import World

    s = World(seed=seed, split=split, config=world_config()).sample(n)
    return to_pixels([x.image for x in s]), torch.tensor([x.class_label for x in s])


def _cosine_lr(opt, base, step, total, warmup=50):
    lr = base * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(step, total) / total))
    for g in opt.param_groups:
        g["lr"] = lr


def make_vae(c: MARTrainConfig):
    from diffusers import AutoencoderKL

    n = len(c.vae_channels)
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n,
                         up_block_types=("UpDecoderBlock2D",) * n, block_out_channels=c.vae_channels,
                         layers_per_block=1, latent_channels=c.latent_channels, norm_num_groups=16, sample_size=64)


def make_mar(c: MARTrainConfig, dim: int, depth: int, head: tuple[int, int]):
    from mmspec.models.mar import MARModel

    return MARModel(img_size=64, vae_stride=2 ** (len(c.vae_channels) - 1), patch_size=1, encoder_embed_dim=dim,
                    encoder_depth=depth, encoder_num_heads=4, decoder_embed_dim=dim, decoder_depth=depth,
                    decoder_num_heads=4, vae_embed_dim=c.latent_channels, class_num=32, buffer_size=c.buffer_size,
                    diffloss_d=head[0], diffloss_w=head[1], num_sampling_steps=c.num_sampling_steps,
                    diffusion_batch_mul=4, diffloss_clip_x0=c.clip_x0)


def psnr(a, b):
    mse = ((a.clamp(-1, 1) - b) ** 2).mean((1, 2, 3))
    return 10 * torch.log10(4.0 / mse)


def train_vae(c, pixels, log, bar):
    torch.manual_seed(c.seed)
    vae = make_vae(c).to(c.device).train()
    opt = torch.optim.AdamW(vae.parameters(), lr=c.vae_lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(c.seed)
    for step in bar(range(c.vae_steps), desc="vae"):
        idx = torch.randint(0, pixels.shape[0], (c.vae_batch,), generator=g)
        x = pixels[idx].to(c.device)
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.sample(generator=None)).sample
        rec_loss = (rec - x).abs().mean() + ((rec - x) ** 2).mean()
        kl = post.kl().mean() / x[0].numel()
        loss = rec_loss + c.vae_kl * kl * x[0].numel()
        _cosine_lr(opt, c.vae_lr, step, c.vae_steps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == c.vae_steps - 1:
            log({"phase": "vae", "step": step, "loss": float(loss), "rec": float(rec_loss)})
    return vae.eval()


@torch.no_grad()
def encode_all(vae, pixels, device, seed):
    torch.manual_seed(seed)
    out = [vae.encode(x.to(device)).latent_dist.sample() for x in pixels.split(128)]
    return torch.cat(out).cpu()


def train_mar(c, model, latents, labels, steps, tag, log, bar):
    torch.manual_seed(c.seed + 1)
    model = model.to(c.device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=c.mar_lr, betas=(0.9, 0.95), weight_decay=0.02)
    g = torch.Generator(device=c.device).manual_seed(c.seed + 2)
    gi = torch.Generator().manual_seed(c.seed + 3)
    for step in bar(range(steps), desc=tag):
        idx = torch.randint(0, latents.shape[0], (c.mar_batch,), generator=gi)
        loss = model(latents[idx].to(c.device), labels[idx].to(c.device), generator=g)
        _cosine_lr(opt, c.mar_lr, step, steps, warmup=100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            log({"phase": tag, "step": step, "loss": float(loss)})
    return model.eval()


def run(c: MARTrainConfig, out_dir: str) -> dict:
    from tqdm import tqdm

    from mmspec.pipelines import SpeculativeMARPipeline

    torch.set_num_threads(c.threads)
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.perf_counter()
    logf = open(os.path.join(out_dir, "train_log.jsonl"), "w")

    def log(rec):
        rec["t"] = round(time.perf_counter() - t0, 1)
        logf.write(json.dumps(rec) + "\n")
        logf.flush()
        print(json.dumps(rec), flush=True)

    bar = lambda it, desc: tqdm(it, desc=desc, mininterval=10)
    pixels, labels = scenes("train", c.n_train, c.seed)
    log({"phase": "data", "n": c.n_train})
    vae = train_vae(c, pixels, log, bar)
    lat = encode_all(vae, pixels, c.device, c.seed)
    scale = float(1.0 / lat.std())
    vae.register_to_config(scaling_factor=scale)
    lat = lat * scale
    target = train_mar(c, make_mar(c, c.target_dim, c.target_depth, c.target_head), lat, labels, c.mar_steps, "target", log, bar)
    drafter = train_mar(c, make_mar(c, c.draft_dim, c.draft_depth, c.draft_head), lat, labels, c.draft_steps, "drafter", log, bar)
    train_s = time.perf_counter() - t0
    pipe = SpeculativeMARPipeline(transformer=target.float(), vae=vae.float(), drafter=drafter.float())
    metrics = {"config": dataclasses.asdict(c), "train_seconds": round(train_s, 1), "latent_scale": scale}
    metrics.update(evaluate(pipe, c))
    pipe.to(torch.float16).save_pretrained(out_dir)
    with open(os.path.join(out_dir, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    log({"phase": "done", **{k: v for k, v in metrics.items() if k != "config"}})
    logf.close()
    return metrics


@torch.no_grad()
def evaluate(pipe, c: MARTrainConfig, judge_dir: str = "assets/testbed/judge") -> dict:
    from mmspec.testbed.judge_model import Judge

    judge = Judge.from_pretrained(judge_dir)
    val_px, val_lab = scenes("validation", c.n_eval, c.seed)
    lat = pipe.vae.encode(val_px).latent_dist.mean
    rec = pipe.vae.decode(lat).sample
    real = judge.score(val_px, val_lab.tolist())
    labels = torch.arange(c.n_eval) % 32
    out = {"vae_psnr_db": float(psnr(rec, val_px).mean()), "judge_real_subset": real,
           "judge_vae_recon": judge.score(rec.clamp(-1, 1), val_lab.tolist())}
    pipe.set_progress_bar_config(disable=True)
    for spec in (False, True):
        t = time.perf_counter()
        res = pipe(labels.tolist(), num_iter=c.eval_num_iter, guidance_scale=c.eval_guidance, speculative=spec,
                   generator=torch.Generator().manual_seed(c.seed), output_type="pt")
        name = "speculative" if spec else "plain"
        out[name] = {**judge.score(res.images * 2 - 1, labels.tolist()), "seconds": round(time.perf_counter() - t, 2),
                     "target_calls": res.stats.spec.target_calls, "draft_calls": res.stats.spec.draft_calls,
                     "acceptance_rate": res.stats.acceptance_rate, "fallbacks": res.stats.fallbacks}
    return out


def add_mar_command(sub) -> None:
    p = sub.add_parser("train-mar", help="train the testbed MAR pair (VAE, target, drafter)")
    p.add_argument("--out", required=True)
    for f in dataclasses.fields(MARTrainConfig):
        if f.type in ("int", "float", "str"):
            p.add_argument("--" + f.name.replace("_", "-"), type={"int": int, "float": float, "str": str}[f.type],
                           default=f.default)
    p.set_defaults(func=cmd_train_mar)


def cmd_train_mar(args) -> int:
    fields = {f.name for f in dataclasses.fields(MARTrainConfig) if f.type in ("int", "float", "str")}
    try:
        config = MARTrainConfig(**{k: getattr(args, k) for k in fields})
    except ValueError as e:
        raise SystemExit(f"mmspec testbed train-mar: {e}") from None
    metrics = run(config, args.out)
    print(json.dumps({k: v for k, v in metrics.items() if k != "config"}, indent=2))
    return 0
