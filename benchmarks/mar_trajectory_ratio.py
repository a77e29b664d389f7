"""Would an exact *trajectory-level* CSpD test accept more drafts than the last-step test?

mmspec's exact `ContinuousAcceptance` compares the last denoising step of the two MAR heads,
each reached along its own trajectory from the shared noise; on the testbed pair the two land
~16 standard deviations apart and nothing is accepted. An exact alternative treats the whole
denoising trajectory as the drafted object: the draft's states x_T, ..., x_0 are scored under
both heads' Gaussian steps *along the draft's own states*, and the draft is accepted with
min(1, prod_t p(x_{t-1} | x_t) / q(x_{t-1} | x_t)) (speculative sampling over trajectories,
exact for the emitted x_0; a rejection would redraw a target trajectory from the residual).
Here the target never leaves the draft's path, so the models' gap cannot compound over steps.

This script measures both acceptance rates on the bundled pair, on the tokens of generation
steps 3..15 of plain samples (CFG 3.0 linear, 16 steps), and the mean log ratio each head step
contributes. Session 33 (2026-11-26): temperature 0.7: last-step test 0.0000, trajectory test
0.0209; temperature 1.0: 0.0000 and 0.0417, over 1952 tokens; the second-to-last step, from
x_2 to x_1 (whose posterior variance is tiny), gives -41.6 of the log ratio at 0.7, the first
step -0.95, the other 23 steps -0.03 to -3.4 each. So the trajectory test is not worth building for this pair.

    python benchmarks/mar_trajectory_ratio.py [--temperature 0.7] [--model assets/testbed/mar]
"""

from __future__ import annotations

import argparse

import torch

from mmspec.assets_dir import ASSETS


def log_normal(x, mean, std):
    z = (x - mean) / std
    return (-0.5 * z * z - torch.log(std)).sum(-1)


@torch.no_grad()
def main() -> None:
    from mmspec.models.mar import mar_schedule
    from mmspec.pipelines import SpeculativeMARPipeline
    from mmspec.pipelines.cspd import _cfg_scales, draw_noise, sample_mar

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ASSETS / "testbed" / "mar"))
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--num-iter", type=int, default=16)
    ap.add_argument("--guidance-scale", type=float, default=3.0)
    args = ap.parse_args()

    pipe = SpeculativeMARPipeline.from_pretrained(args.model).to(torch.float32)
    target, drafter = pipe.transformer.eval(), pipe.drafter.eval()
    B, temp, n_iter = args.batch, args.temperature, args.num_iter
    labels = torch.arange(B) % target.config.class_num
    L, D, S = target.seq_len, target.token_embed_dim, target.diffloss.gen.num_steps
    noise = draw_noise(B, L, D, S, torch.Generator().manual_seed(1), "cpu", torch.float32)
    tokens, _ = sample_mar(target, labels, num_iter=n_iter, guidance_scale=args.guidance_scale,
                           cfg_schedule="linear", temperature=temp, noise=noise)
    masked, lens = mar_schedule(L, n_iter)
    cfg_of_step = _cfg_scales(lens, L, args.guidance_scale, "linear")
    rank = torch.empty_like(noise.orders)
    rank.scatter_(1, noise.orders, torch.arange(L).expand(B, L))
    rank_step = torch.empty(L, dtype=torch.long)
    for s in range(n_iter):
        rank_step[masked[s + 1]: masked[s]] = s
    pos_step = rank_step[rank]

    def conditioning(model, known, seq, pos, step):
        emb = model.class_embedding(labels, B)
        z = model.forward_z(torch.cat([tokens, tokens]), torch.cat([known, known]),
                            torch.cat([emb, model.class_embedding(None, B)]))
        zc, zu = z.chunk(2)
        return zc[seq, pos], zu[seq, pos], torch.full((seq.numel(),), float(cfg_of_step[step]))

    gen = torch.Generator().manual_seed(2)
    last_sum, joint_sum, count = 0.0, 0.0, 0
    per_step = torch.zeros(S, dtype=torch.float64)
    for step in range(3, n_iter):
        known = pos_step < step
        seq, pos = (pos_step == step).nonzero(as_tuple=True)
        zq, zuq, cfg = conditioning(drafter, known, seq, pos, step)
        zp, zup, _ = conditioning(target, known, seq, pos, step)
        hq, hp = drafter.diffloss, target.diffloss
        cq, cp = hq.cond_embedding(zq, zuq), hp.cond_embedding(zp, zup)
        N = seq.numel()
        x = torch.randn(N, D, generator=gen)  # shared x_T
        x_target = x.clone()
        log_joint = torch.zeros(N, dtype=torch.float64)
        for i in range(S - 1, -1, -1):
            mq, sq = hq.gaussian_step(x, i, zq, zuq, cfg, temp, cq)
            mp, sp = hp.gaussian_step(x, i, zp, zup, cfg, temp, cp)  # the target along the draft's state
            eps = torch.randn(N, D, generator=gen, dtype=torch.float64)  # shared step noise
            x_next = mq + sq * eps
            term = log_normal(x_next, mp, sp) - log_normal(x_next, mq, sq)
            per_step[i] += term.sum()
            log_joint += term
            mt, st = hp.gaussian_step(x_target, i, zp, zup, cfg, temp, cp)  # the target's own trajectory
            if i == 0:
                log_last = log_normal(x_next, mt, st) - log_normal(x_next, mq, sq)
            x_target = (mt + st * eps).float()
            x = x_next.float()
        last_sum += float(log_last.clamp(max=0).exp().sum())
        joint_sum += float(log_joint.clamp(max=0).exp().sum())
        count += N
    print(f"temperature {temp}: {count} tokens; last-step test acceptance {last_sum / count:.4f}; "
          f"trajectory test acceptance {joint_sum / count:.4f}")
    print("mean log ratio per head step (first step ... last step):",
          [round(v, 2) for v in (per_step / count).flip(0).tolist()])


if __name__ == "__main__":
    main()
