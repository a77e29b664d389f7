"""Train the testbed's MAR pair on CPU: a small diffusers `AutoencoderKL`, a MAR target and a
smaller MAR drafter on its latents, for `SpeculativeMARPipeline`.

What: 64x64 procedural-world scenes (`mmspec.testbed.world`) restricted to ONE object on a
PLAIN background, its centre within +-6% of the image middle (`main_position="centre"`), size
and background colour still random (32 classes = 4 shapes x 8 colours). Why this subset and
grid: a CPU-trained generator must get shape and colour right to be recognisable, and every
extra object or texture is capacity it does not have. Centring is the lever that worked: on
objects placed anywhere, the same recipe stayed at 12-16% (history below), because the small
transformer did not carry *where* the object is from the known tokens to the masked ones. The
VAE downsamples by 8 (3 levels) to an 8 x 8 grid of 8-dim tokens: a first run at stride 16
(4 x 4 tokens) lost the shape already in the VAE (judge 19.9% on its reconstructions), as the
16x16 -> 8x8 VQ did for the discrete generator.

Stages (`--stages vae,target,drafter,eval`, each saved under `--work`, default `OUT_work`, so
a killed run keeps its finished stages and the VAE can be checked before MAR is trained):
vae (train, encode the training scenes, PSNR and judge on 256 validation reconstructions),
target, drafter, eval (judge + Frechet of 256 plain and 256 CSpD samples; writes the fp16
pipeline, metrics.json, the stage logs and a contact sheet to `--out`).

Recipe: VAE = pixel L1 + MSE + 1e-6 KL (latent-diffusion style, no GAN / LPIPS), 32 px crops
for the first steps (4x cheaper, the model is convolutional) and whole scenes for the last
`vae_full_steps`; latents scaled to unit std (the factor is stored as `scaling_factor`, as
MAR's 0.2325). MAR = official loss (random order, truncated-Gaussian mask ratio, class dropout
0.1, diffusion loss with the cosine schedule and learned variance; without the official blocks'
attention / projection dropout of 0.1, which MARModel does not have). AdamW, cosine LR, fixed
seeds, losses logged every 100 steps. `eval_num_iter` = 16 generation steps for 64 tokens
(stored in metrics.json, which `mmspec generate` / `bench mar` read as the folder's default).

Limits: a toy for a toy world; numbers hold for World(seed=0) centred single-object scenes.
Measured with these defaults (seed 0, 1 thread; the target and the drafter
stage ran at once on the two cores, then the eval stage with 2 threads): VAE 1139 s, PSNR 33.0
dB, judge 100% on its reconstructions; target 1.11M params, 3000 steps, 2450 s, loss 1.93 ->
0.105; drafter 0.28M, 1200 steps, 511 s, loss -> 0.136. Plain samples (256, guidance 3.0
linear, 16 steps, temperature 0.7): judge class accuracy 59.0% (colour 84.0%, shape 66.4%,
Frechet 62.2; chance 3.1%); at temperature 1.0: 52.3% (colour 83.6%, shape 59.4%). The
temperature was chosen on 128 samples (0.5: 64.1%, 0.7: 64.8%, 1.0: 56.2%; guidance 2 / 5,
the constant schedule and 32 steps: 55.5-58.6%); the drafter alone: 30.5% of 128 at 1.0. The
shapes come out as rounded blobs: colour is learnt, shape two times in three.

History (objects anywhere, 6000 scenes): the same target reached 16.0% (colour 62.9%, shape
29.3%); 1800 further steps 15-16%; a 3.2M-parameter target (dim 160, depth 3 + 3, head 3 x 256,
2000 steps, 73 min) 12.5-14.1%. Inpainting with half the tokens known showed why: erasing every
known object token moved the head's x0 estimate for masked object tokens by only 2%, i.e. the
transformer passed scene-global facts (background, colour) but not the object's position.

CSpD: exact verification accepts almost nothing between two different MARs (acceptance 6e-5
on this pair): the last-step Gaussians have std ~0.006 while the two models' means differ by
~0.1. See `mmspec bench mar` and docs/algorithms.md section 5 for the relaxed test.
Run: `mmspec testbed train-mar --out DIR` (see `add_mar_command`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time

import torch

from mmspec.devices import check_device
from mmspec.testbed.judge_model import JUDGE_DIR


STAGES = ("vae", "target", "drafter", "eval")


@dataclasses.dataclass(frozen=True)
class MARTrainConfig:
    seed: int = 0
    threads: int = 2
    device: str = "cpu"
    n_train: int = 12000
    n_eval: int = 256
    vae_steps: int = 3000
    vae_full_steps: int = 600  # the last steps train on whole 64 px scenes, the others on vae_crop crops
    vae_crop: int = 32
    vae_batch: int = 16
    vae_lr: float = 2e-3
    vae_kl: float = 1e-6
    vae_channels: tuple[int, ...] = (16, 32, 64, 64)  # 3 downsamplings: 64 px -> 8 x 8 tokens
    latent_channels: int = 8
    mar_steps: int = 3000
    mar_batch: int = 64
    mar_lr: float = 1e-3
    mask_ratio_min: float = 0.7  # MAR's training mask ratio is a truncated Gaussian on [mask_ratio_min, 1]
    target_dim: int = 128
    target_depth: int = 2
    target_head: tuple[int, int] = (2, 128)  # diffusion head depth, width
    draft_steps: int = 1200
    draft_dim: int = 64
    draft_depth: int = 1
    draft_head: tuple[int, int] = (2, 96)
    num_sampling_steps: int = 25
    clip_x0: float = 4.0  # clamp of the head's x0 estimate (latents have unit std); see mar_diffloss
    buffer_size: int = 8
    eval_num_iter: int = 16
    eval_guidance: float = 3.0
    eval_temperature: float = 0.7  # the sampling temperature the eval and the folder default use
    main_position: str = "centre"  # the world's main_position: "centre" (+-centre_jitter) or "anywhere"
    centre_jitter: float = 0.06

    def __post_init__(self):
        self.world_config()  # validates main_position / centre_jitter
        for name in ("n_train", "n_eval", "vae_steps", "vae_batch", "vae_crop", "mar_steps", "mar_batch",
                     "draft_steps", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"MARTrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.vae_full_steps <= self.vae_steps:
            raise ValueError(f"MARTrainConfig.vae_full_steps must be in 0..vae_steps={self.vae_steps}, "
                             f"got {self.vae_full_steps}")
        stride = 2 ** (len(self.vae_channels) - 1)
        if self.vae_crop > 64 or self.vae_crop % stride:
            raise ValueError(f"MARTrainConfig.vae_crop must be <= 64 and a multiple of the VAE stride {stride}, "
                             f"got {self.vae_crop}")
        if not (math.isfinite(self.eval_temperature) and self.eval_temperature > 0):
            raise ValueError(f"MARTrainConfig.eval_temperature must be a finite number > 0, got {self.eval_temperature}")
        # Checked here, not at the eval stage after an hour of training (or never: vae_kl, buffer_size).
        if not math.isfinite(self.eval_guidance):
            raise ValueError(f"MARTrainConfig.eval_guidance must be a finite number, got {self.eval_guidance}")
        if not (math.isfinite(self.vae_kl) and self.vae_kl >= 0):
            raise ValueError(f"MARTrainConfig.vae_kl must be a finite number >= 0, got {self.vae_kl}")
        if self.buffer_size < 0:
            raise ValueError(f"MARTrainConfig.buffer_size must be >= 0, got {self.buffer_size}")
        if not 0.0 <= self.mask_ratio_min < 1.0:
            raise ValueError(f"MARTrainConfig.mask_ratio_min must be in [0, 1), got {self.mask_ratio_min}")
        if self.n_eval < 2:
            raise ValueError("MARTrainConfig.n_eval must be >= 2 (Frechet needs a covariance)")
        check_device(self.device, "MARTrainConfig.device")  # before the VAE stage, not after it
        # Also before the VAE stage trains for minutes: learning rates, and the two MARs' shapes
        # (--target-dim 0 trained the VAE, then failed building the target), built on the meta device.
        for name in ("vae_lr", "mar_lr"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"MARTrainConfig.{name} must be a finite number > 0, got {v}")
        for name in ("target_dim", "target_depth", "draft_dim", "draft_depth", "latent_channels", "num_sampling_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"MARTrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        with torch.device("meta"):
            target = make_mar(self, self.target_dim, self.target_depth, self.target_head)
            make_mar(self, self.draft_dim, self.draft_depth, self.draft_head)
        from mmspec.models.mar import mar_schedule

        try:
            mar_schedule(target.seq_len, self.eval_num_iter)  # eval_num_iter in [1, tokens]
        except ValueError as e:
            raise ValueError(f"MARTrainConfig.eval_num_iter: {e}") from None


    def world_config(self):
        from mmspec.testbed.world import WorldConfig

        return WorldConfig(max_objects=1, backgrounds=("plain",), main_position=self.main_position,
                           centre_jitter=self.centre_jitter)


def scenes(c: MARTrainConfig, split: str, n: int):
    from mmspec.testbed.judge_model import to_pixels
    from mmspec.testbed.world import World

    s = World(seed=c.seed, split=split, config=c.world_config()).sample(n)
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
                    diffusion_batch_mul=4, diffloss_clip_x0=c.clip_x0, mask_ratio_min=c.mask_ratio_min)


def psnr(a, b):
    mse = ((a.clamp(-1, 1) - b) ** 2).mean((1, 2, 3))
    return 10 * torch.log10(4.0 / mse)


def _crops(x, size, g):
    """One random `size` x `size` crop per image (the same offsets for a whole batch)."""
    if size >= x.shape[-1]:
        return x
    i, j = (int(v) for v in torch.randint(0, x.shape[-1] - size + 1, (2,), generator=g))
    return x[..., i:i + size, j:j + size]


def train_vae(c, pixels, log, bar):
    """Pixel L1 + MSE + `vae_kl` x KL; crops first (4x cheaper per step), whole scenes last."""
    torch.manual_seed(c.seed)
    vae = make_vae(c).to(c.device).train()
    opt = torch.optim.AdamW(vae.parameters(), lr=c.vae_lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(c.seed)
    for step in bar(range(c.vae_steps), desc="vae"):
        idx = torch.randint(0, pixels.shape[0], (c.vae_batch,), generator=g)
        full = step >= c.vae_steps - c.vae_full_steps
        x = (pixels[idx] if full else _crops(pixels[idx], c.vae_crop, g)).to(c.device)
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.sample(generator=None)).sample
        rec_loss = (rec - x).abs().mean() + ((rec - x) ** 2).mean()
        kl = post.kl().mean()
        loss = rec_loss + c.vae_kl * kl
        _cosine_lr(opt, c.vae_lr, step, c.vae_steps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == c.vae_steps - 1:
            log({"phase": "vae", "step": step, "size": x.shape[-1], "loss": loss.detach().item(),
                 "rec": rec_loss.detach().item()})
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
            log({"phase": tag, "step": step, "loss": loss.detach().item()})
    return model.eval()


@torch.no_grad()
def vae_quality(vae, c: MARTrainConfig, judge_dir: str = str(JUDGE_DIR)) -> dict:
    """PSNR and judge scores of the VAE's reconstructions of `n_eval` validation scenes (the
    ceiling for any generator on these latents)."""
    from mmspec.testbed.judge_model import Judge

    judge = Judge.from_pretrained(judge_dir)
    val_px, val_lab = scenes(c, "validation", c.n_eval)
    rec = torch.cat([vae.decode(vae.encode(x.to(c.device)).latent_dist.mean).sample.cpu() for x in val_px.split(128)])
    return {"vae_psnr_db": float(psnr(rec, val_px).mean()), "judge_real_subset": judge.score(val_px, val_lab.tolist()),
            "judge_vae_recon": judge.score(rec.clamp(-1, 1), val_lab.tolist())}


def stage_vae(c, work, log, bar) -> dict:
    from diffusers import AutoencoderKL  # noqa: F401  (fail early when diffusers is missing)

    pixels, labels = scenes(c, "train", c.n_train)
    log({"phase": "data", "n": c.n_train})
    vae = train_vae(c, pixels, log, bar)
    lat = encode_all(vae, pixels, c.device, c.seed)
    scale = float(1.0 / lat.std())
    vae.register_to_config(scaling_factor=scale)
    vae.save_pretrained(os.path.join(work, "vae"))
    torch.save({"latents": lat * scale, "labels": labels}, os.path.join(work, "latents.pt"))
    return {"latent_scale": scale, **vae_quality(vae, c)}


def _load_vae(work, device):
    from diffusers import AutoencoderKL

    return AutoencoderKL.from_pretrained(os.path.join(work, "vae")).to(device).eval()


def stage_mar(c, work, log, bar, tag) -> dict:
    data = torch.load(os.path.join(work, "latents.pt"))
    dim, depth, head, steps = ((c.target_dim, c.target_depth, c.target_head, c.mar_steps) if tag == "target" else
                               (c.draft_dim, c.draft_depth, c.draft_head, c.draft_steps))
    # Seeded here, per stage: a stage run on its own (--stages drafter) drew its initial weights from
    # an unseeded generator and was not reproducible (as the bundled drafter, see assets/testbed/README.md).
    torch.manual_seed(c.seed + (10 if tag == "target" else 20))
    model = make_mar(c, dim, depth, head)
    model = train_mar(c, model, data["latents"], data["labels"], steps, tag, log, bar)
    model.save_pretrained(os.path.join(work, tag))
    return {"params": sum(p.numel() for p in model.parameters())}


def stage_eval(c, work, out_dir) -> dict:
    from mmspec.models.mar import MARModel
    from mmspec.pipelines import SpeculativeMARPipeline
    from mmspec.testbed.bundle_paths import drop_machine_paths

    target = MARModel.from_pretrained(os.path.join(work, "target")).to(c.device).eval()
    drafter = MARModel.from_pretrained(os.path.join(work, "drafter")).to(c.device).eval()
    pipe = SpeculativeMARPipeline(transformer=target, vae=_load_vae(work, c.device), drafter=drafter)
    result = evaluate(pipe, c, out_dir)
    pipe.to(torch.float16).save_pretrained(out_dir)
    drop_machine_paths(out_dir)  # the stages were loaded from `work`: no trainer's path in the bundle
    return result


def run(c: MARTrainConfig, out_dir: str, stages=STAGES, work: str | None = None) -> dict:
    """Run `stages` in order; each saves its result under `work` (default `OUT_work`) and its
    record in `work/metrics.json`, so a killed run keeps its finished stages. The eval stage
    writes the fp16 pipeline, metrics.json and the stage logs to `out_dir`."""
    from tqdm import tqdm

    torch.set_num_threads(c.threads)
    work = work or out_dir.rstrip("/") + "_work"
    os.makedirs(work, exist_ok=True)
    record_path = os.path.join(work, "metrics.json")
    record = json.load(open(record_path)) if os.path.isfile(record_path) else {}
    bar = lambda it, desc: tqdm(it, desc=desc, mininterval=10)
    for stage in STAGES:
        if stage not in stages:
            continue
        t0 = time.perf_counter()
        logf = open(os.path.join(work, f"{stage}_log.jsonl"), "w")

        def log(rec):
            rec["t"] = round(time.perf_counter() - t0, 1)
            logf.write(json.dumps(rec) + "\n")
            logf.flush()
            print(json.dumps(rec), flush=True)

        if stage == "vae":
            result = stage_vae(c, work, log, bar)
        elif stage in ("target", "drafter"):
            result = stage_mar(c, work, log, bar, stage)
        else:
            os.makedirs(out_dir, exist_ok=True)
            result = stage_eval(c, work, out_dir)
        result["seconds"] = round(time.perf_counter() - t0, 1)
        record[stage] = {"config": dataclasses.asdict(c), **result}
        log({"phase": stage + " done", **result})
        logf.close()
        with open(record_path, "w") as f:
            json.dump(record, f, indent=2)
    if "eval" in stages:
        metrics = {"config": dataclasses.asdict(c), **record.get("vae", {}), **record["eval"],
                   "stage_seconds": {s: record[s]["seconds"] for s in STAGES if s in record}}
        metrics.pop("seconds", None)
        for s in STAGES:
            src = os.path.join(work, f"{s}_log.jsonl")
            if os.path.isfile(src):
                shutil.copy(src, os.path.join(out_dir, f"train_log_{s}.jsonl"))
        with open(os.path.join(out_dir, "metrics.json"), "w") as f:
            json.dump(metrics, f, indent=2)
        return metrics
    return record


@torch.no_grad()
def evaluate(pipe, c: MARTrainConfig, out_dir: str | None = None, judge_dir: str = str(JUDGE_DIR)) -> dict:
    """Judge class / colour / shape accuracy and Frechet of `n_eval` plain and `n_eval` CSpD
    samples (class labels 0..31 in turn, seed `c.seed`), with the sampler's counters; with
    `out_dir`, a contact sheet of the first 128 plain samples under real scenes."""
    from mmspec.testbed.imagegen_train import contact_sheet, judge_breakdown
    from mmspec.testbed.judge_model import Judge

    judge = Judge.from_pretrained(judge_dir)
    labels = torch.arange(c.n_eval) % 32
    out = {"eval_num_iter": c.eval_num_iter, "eval_guidance": c.eval_guidance, "eval_temperature": c.eval_temperature}
    pipe.set_progress_bar_config(disable=True)
    for spec in (False, True):
        t = time.perf_counter()
        res = pipe(labels.tolist(), num_iter=c.eval_num_iter, guidance_scale=c.eval_guidance,
                   temperature=c.eval_temperature, speculative=spec,
                   generator=torch.Generator().manual_seed(c.seed), output_type="pt")
        name = "speculative" if spec else "plain"
        px = res.images.float().cpu() * 2 - 1
        out[name] = {**judge_breakdown(judge, px, labels, 8), "seconds": round(time.perf_counter() - t, 2),
                     "target_calls": res.stats.spec.target_calls, "draft_calls": res.stats.spec.draft_calls,
                     "acceptance_rate": res.stats.acceptance_rate, "fallbacks": res.stats.fallbacks}
        if out_dir is not None and not spec:
            real, real_labels = scenes(c, "validation", 256)
            contact_sheet(px[:128], labels[:128], real, real_labels, os.path.join(out_dir, "contact_sheet.png"))
    return out


def add_mar_command(sub) -> None:
    p = sub.add_parser("train-mar", help="train the testbed MAR pair (VAE, target, drafter)")
    p.add_argument("--out", required=True, help="where the eval stage writes the fp16 pipeline and metrics.json")
    p.add_argument("--work", default=None, help="stage results (default OUT_work)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    for f in dataclasses.fields(MARTrainConfig):
        if f.type in ("int", "float", "str"):
            p.add_argument("--" + f.name.replace("_", "-"), type={"int": int, "float": float, "str": str}[f.type],
                           default=f.default)
    p.set_defaults(func=cmd_train_mar)


def cmd_train_mar(args) -> int:
    fields = {f.name for f in dataclasses.fields(MARTrainConfig) if f.type in ("int", "float", "str")}
    stages = tuple(s.strip() for s in args.stages.split(",") if s.strip())
    bad = [s for s in stages if s not in STAGES]
    if bad or not stages:
        raise SystemExit(f"mmspec testbed train-mar: unknown stages {bad or [args.stages]}; known: {list(STAGES)}")
    try:
        config = MARTrainConfig(**{k: getattr(args, k) for k in fields})
    except ValueError as e:
        raise SystemExit(f"mmspec testbed train-mar: {e}") from None
    metrics = run(config, args.out, stages=stages, work=args.work)
    print(json.dumps({k: v for k, v in metrics.items() if k != "config"}, indent=2, default=str)[:4000])
    return 0
