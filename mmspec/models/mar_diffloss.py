"""MAR's per-token diffusion head ("Diffusion Loss"): a small AdaLN MLP that denoises one
continuous token conditioned on the transformer's output z, with the cosine noise schedule,
learned (interpolated) variance and respaced DDPM sampling with a temperature.

Source: Li et al., "Autoregressive Image Generation without Vector Quantization" (NeurIPS
2024, arXiv 2406.11838); public code github.com/LTH14/mar (`models/diffloss.py`,
`diffusion/`, itself adapted from DiT / improved-diffusion). Parameter names follow the
official `diffloss.net.*` layout so that `checkpoint-last.pth` loads unchanged.

Schedule. 1000 training steps with the improved-DDPM cosine alpha-bar
(`cos((t + 0.008) / 1.008 * pi / 2)^2`, betas capped at 0.999), respaced to
`num_sampling_steps` by improved-diffusion's `space_timesteps` (evenly strided, rounded) with
the betas recomputed from the kept alpha-bars. diffusers' `DDPMScheduler(beta_schedule=
"squaredcos_cap_v2")` has the same 1000 betas, but in float32 and without access to the
per-step Gaussian parameters that speculative verification needs, so the schedule is
computed here in float64 (the test checks it against diffusers' betas). Variance:
`log var = f * log beta_t + (1 - f) * log posterior_var_clipped_t`, `f = (v + 1) / 2`.

Limits / one deliberate difference. The official sampler adds no noise at the last step
(t = 0). `final_step_noise=True` (what the speculative sampler needs, so that the last step
is a Gaussian; CSpD) adds `std_0 * temperature * eps` there, with `std_0` the model's own
t = 0 standard deviation (about 0.006 for the cosine schedule); `final_step_noise=False`
reproduces the official sampler exactly.

Small heads: the first respaced step starts at t = 999, where alpha-bar is ~2e-9, so the x0
estimate multiplies the eps error by ~2e4 (the posterior mean by ~1e3); a head trained for
minutes (eps RMSE ~0.05 there) then diverges. `clip_x0=c` clamps the x0 estimate to [-c, c]
(improved-diffusion's `clip_denoised` with c = 1); None (default) is the official sampler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from mmspec.sampling import draw


def cosine_betas(num_timesteps: int = 1000, max_beta: float = 0.999) -> torch.Tensor:
    """improved-DDPM cosine schedule, float64 [T]."""
    ab = lambda t: math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
    return torch.tensor([min(1 - ab((i + 1) / num_timesteps) / ab(i / num_timesteps), max_beta)
                         for i in range(num_timesteps)], dtype=torch.float64)


def space_timesteps(num_timesteps: int, count: int) -> list[int]:
    """Evenly strided subset of `count` of `num_timesteps` steps (improved-diffusion's rule
    for one section), ascending. The stride is *accumulated* as the official code does: for 278
    counts (21, 23, 31, ...) the running sum rounds differently from `round(i * stride)` (21 steps
    keep t=499, not 500), and the schedule would not be the official one."""
    if not 2 <= count <= num_timesteps:  # the official sampler has no variance for a single step
        raise ValueError(f"num_sampling_steps must be in [2, {num_timesteps}], got {count}")
    stride = (num_timesteps - 1) / (count - 1)
    taken, position = set(), 0.0
    for _ in range(count):
        taken.add(round(position))
        position += stride
    return sorted(taken)


class RespacedCosineSchedule:
    """Per-step constants of the respaced DDPM (all float64 [S], index 0 = last step)."""

    def __init__(self, num_sampling_steps: int, num_train_timesteps: int = 1000) -> None:
        base = cosine_betas(num_train_timesteps)
        keep = space_timesteps(num_train_timesteps, num_sampling_steps)
        ac_base = torch.cumprod(1 - base, 0)
        ac = ac_base[keep]
        ac_prev_kept = torch.cat([torch.ones(1, dtype=torch.float64), ac[:-1]])
        self.timestep_map = torch.tensor(keep, dtype=torch.long)  # [S] original timesteps
        self.num_steps = len(keep)
        betas = 1 - ac / ac_prev_kept
        self.betas = betas
        self.alphas_cumprod = ac
        ac_prev = ac_prev_kept
        self.sqrt_recip_ac = torch.sqrt(1 / ac)
        self.sqrt_recipm1_ac = torch.sqrt(1 / ac - 1)
        self.sqrt_ac = torch.sqrt(ac)
        self.sqrt_1m_ac = torch.sqrt(1 - ac)
        post_var = betas * (1 - ac_prev) / (1 - ac)
        self.posterior_variance = post_var
        # log of the posterior variance with its (zero) value at t = 0 replaced by t = 1's
        clipped = torch.cat([post_var[1:2], post_var[1:]])
        self.min_log = torch.log(clipped)
        self.max_log = torch.log(betas)
        self.coef1 = betas * torch.sqrt(ac_prev) / (1 - ac)
        self.coef2 = (1 - ac_prev) * torch.sqrt(1 - betas) / (1 - ac)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden: int, freq_dim: int = 256) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.freq_dim = freq_dim

    def forward(self, t: torch.Tensor) -> torch.Tensor:  # t [N] -> [N, hidden]
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], -1)
        if self.freq_dim % 2:
            emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], -1)
        return self.mlp(emb.to(self.mlp[0].weight.dtype))


class ResBlock(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.in_ln = nn.LayerNorm(ch, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(ch, ch), nn.SiLU(), nn.Linear(ch, ch))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(ch, 3 * ch))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = self.adaLN_modulation(y).chunk(3, -1)
        return x + gate * self.mlp(modulate(self.in_ln(x), shift, scale))


class FinalLayer(nn.Module):
    def __init__(self, ch: int, out: int) -> None:
        super().__init__()
        self.norm_final = nn.LayerNorm(ch, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(ch, out)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(ch, 2 * ch))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(y).chunk(2, -1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class SimpleMLPAdaLN(nn.Module):
    """eps and variance-interpolation prediction for one token: (x [N, D], t [N], c [N, Z])
    -> [N, 2D]."""

    def __init__(self, in_channels: int, width: int, z_channels: int, depth: int) -> None:
        super().__init__()
        self.in_channels = in_channels
        self.time_embed = TimestepEmbedder(width)
        self.cond_embed = nn.Linear(z_channels, width)
        self.input_proj = nn.Linear(in_channels, width)
        self.res_blocks = nn.ModuleList(ResBlock(width) for _ in range(depth))
        self.final_layer = FinalLayer(width, 2 * in_channels)
        self._init()

    def _init(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.normal_(self.time_embed.mlp[0].weight, std=0.02)
        nn.init.normal_(self.time_embed.mlp[2].weight, std=0.02)
        for b in self.res_blocks:
            nn.init.zeros_(b.adaLN_modulation[-1].weight)
            nn.init.zeros_(b.adaLN_modulation[-1].bias)
        for p in (self.final_layer.adaLN_modulation[-1].weight, self.final_layer.adaLN_modulation[-1].bias,
                  self.final_layer.linear.weight, self.final_layer.linear.bias):
            nn.init.zeros_(p)

    def forward(self, x: torch.Tensor, t: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return self.forward_y(x, self.time_embed(t) + self.cond_embed(c))

    def forward_y(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`forward` with y = time_embed(t) + cond_embed(c) given (the sampler computes
        cond_embed once per token and time_embed once per step)."""
        x = self.input_proj(x)
        for block in self.res_blocks:
            x = block(x, y)
        return self.final_layer(x, y)


@dataclass
class HeadTrajectory:
    """Result of denoising flat tokens along given noise."""

    sample: torch.Tensor  # [N, D] the emitted token
    mean: torch.Tensor  # [N, D] mean of the last (t = 0) Gaussian step
    std: torch.Tensor  # [N, D] its standard deviation (temperature applied), > 0
    # With record=True: the input of every step (column c: step i = S-1-c; column 0 is x_T)
    # and the log density [N] float64 of the whole path under this head (see log_density_along).
    states: torch.Tensor | None = None
    log_density: torch.Tensor | None = None
    alt_log_density: torch.Tensor | None = None  # with alt=...: the paths' density under the other conditioning


def _log_normal(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Diagonal Gaussian log density summed over the last dim, without the 2 pi constant
    (every head's densities leave it out alike, so ratios are exact)."""
    z = (x - mean) / std
    return (-0.5 * z * z - torch.log(std)).sum(-1)


class DiffLoss(nn.Module):
    """Container matching the official `diffloss.*` key layout (`diffloss.net.*`)."""

    def __init__(self, target_channels: int, z_channels: int, depth: int, width: int, num_sampling_steps: int,
                 clip_x0: float | None = None) -> None:
        super().__init__()
        if clip_x0 is not None and not clip_x0 > 0:
            raise ValueError(f"clip_x0 must be None or > 0, got {clip_x0!r}")
        self.clip_x0 = clip_x0
        self.in_channels = target_channels
        self.net = SimpleMLPAdaLN(target_channels, width, z_channels, depth)
        self.set_num_sampling_steps(int(num_sampling_steps))
        self.train_schedule = RespacedCosineSchedule(1000)

    # -- sampling ------------------------------------------------------------------------

    def set_num_sampling_steps(self, num_sampling_steps: int) -> None:
        """Respace the sampler to `num_sampling_steps` steps (an inference setting)."""
        self.num_sampling_steps = num_sampling_steps
        self.gen = RespacedCosineSchedule(num_sampling_steps)

    def cond_embedding(self, z, z_uncond=None):
        """cond_embed of z ([z; z_uncond] under CFG): constant along a trajectory, so computed once."""
        return self.net.cond_embed(z if z_uncond is None else torch.cat([z, z_uncond]))

    def _model_out(self, x, t_orig, z, z_uncond, cfg, c_emb=None):
        """eps (guided when z_uncond is given) and variance logits v, each [N, D].
        t_orig [N] holds ONE timestep for all tokens (a sampler step; its embedding is computed
        once from t_orig[0]). c_emb: cond_embed of z (cat of z, z_uncond under CFG), computed once
        by the caller."""
        if c_emb is None:
            c_emb = self.cond_embedding(z, z_uncond)
        y = self.net.time_embed(t_orig[:1]) + c_emb  # one timestep for all tokens: embed it once
        return self._net_out(x, y, None if z_uncond is None else cfg)

    def _net_out(self, x, y, cfg):
        """eps and variance logits [N, D] from the net given y = time + condition embeddings ([N],
        or [2N] = [cond; uncond] under CFG, when cfg [N] is given)."""
        D, net = self.in_channels, self.net
        if cfg is None:
            out = net.forward_y(x, y)
            return out[:, :D], out[:, D:]
        cond, uncond = net.forward_y(torch.cat([x, x]), y).chunk(2)
        eps = uncond[:, :D] + cfg[:, None] * (cond[:, :D] - uncond[:, :D])
        return eps, cond[:, D:]  # the official forward_with_cfg keeps each half's own variance; the cond half is returned

    def gaussian_step(self, x, i: int, z, z_uncond=None, cfg=None, temperature: float = 1.0, c_emb=None):
        """Mean and std (float64, temperature applied) of p(x_{i-1} | x_i) at respaced step i."""
        s = self.gen
        dev = x.device
        t_orig = torch.full((x.shape[0],), int(s.timestep_map[i]), dtype=torch.long, device=dev)
        eps, v = self._model_out(x, t_orig, z, z_uncond, cfg, c_emb)
        return self._mean_std(x, eps, v, lambda a: float(a[i]), temperature)

    def _path_model_out(self, x, t_steps, z, z_uncond, cfg):
        """`_model_out` for N paths of S steps flattened path-major (x [N*S, D]; t_steps [S] the
        timestep of each column): the time embedding is computed once per step and the
        condition embedding once per path."""
        S = t_steps.shape[0]
        te = self.net.time_embed(t_steps)  # [S, W]
        ce = self.cond_embedding(z, z_uncond)  # [N or 2N, W]
        y = (ce[:, None, :] + te[None]).reshape(-1, te.shape[-1])
        return self._net_out(x, y, None if z_uncond is None else cfg.repeat_interleave(S))

    def _mean_std(self, x, eps, v, at, temperature: float):
        """Mean and std (float64) of a step from the head's eps and variance logits; `at(a)`
        picks a schedule constant of the step (a float, or a column for one step per row)."""
        s = self.gen
        eps, v, x64 = eps.double(), v.double(), x.double()
        pred_x0 = at(s.sqrt_recip_ac) * x64 - at(s.sqrt_recipm1_ac) * eps
        if self.clip_x0 is not None:  # improved-diffusion's clip_denoised, generalised to [-c, c]
            pred_x0 = pred_x0.clamp(-self.clip_x0, self.clip_x0)
        mean = at(s.coef1) * pred_x0 + at(s.coef2) * x64
        frac = (v + 1) / 2
        log_var = frac * at(s.max_log) + (1 - frac) * at(s.min_log)
        return mean, torch.exp(0.5 * log_var) * temperature

    def log_density_along(self, states, sample, z, z_uncond=None, cfg=None, temperature: float = 1.0) -> torch.Tensor:
        """Log density [N] float64 of given denoising paths under this head: states [N, S, D]
        (the input of each step, as `trajectory(record=True)` returns them), sample [N, D] (the
        last step's output). The S steps of every path are evaluated in one batched call (the
        states are given, so nothing is sequential)."""
        N, S, D = states.shape
        s = self.gen
        if S != s.num_steps:
            raise ValueError(f"states hold {S} steps; this head samples in {s.num_steps}")
        dev = states.device
        idx = torch.arange(S - 1, -1, -1, device=dev).repeat(N)  # flat row n*S + c -> step i = S-1-c
        x = states.reshape(N * S, D)
        eps, v = self._path_model_out(x, s.timestep_map.to(dev).flip(0), z, z_uncond, cfg)
        mean, std = self._mean_std(x, eps, v, lambda a: a.to(dev)[idx][:, None], temperature)
        out = torch.cat([states[:, 1:], sample[:, None].to(states.dtype)], 1).reshape(N * S, D).double()
        return _log_normal(out, mean, std).reshape(N, S).sum(1)

    def trajectory(
        self,
        z: torch.Tensor,  # [N, Z] conditioning
        init_noise: torch.Tensor,  # [N, D] x_T
        step_noise: torch.Tensor,  # [N, S-1, D]: noise of steps i = S-1 .. 1 (column S-1-i)
        final_noise: torch.Tensor | None,  # [N, D] noise of the last step, None = official (no noise)
        *,
        z_uncond: torch.Tensor | None = None,  # [N, Z] unconditional z for CFG
        cfg: torch.Tensor | None = None,  # [N] guidance scale per token
        temperature: float = 1.0,
        record: bool = False,
        alt: tuple | None = None,
    ) -> HeadTrajectory:
        """Denoise N tokens along the given noises; deterministic given them. record=True also
        returns every step's input and the path's log density under this head; with
        alt=(rows [M] long, z_alt [M, Z], z_uncond_alt [M, Z] or None) also the log density
        (`alt_log_density` [M]) of the paths of `rows` under the conditioning z_alt, evaluated
        in the same head calls as the sampling (extra rows, not extra calls)."""
        S = self.gen.num_steps
        if step_noise.shape[1] < S - 1:
            raise ValueError(f"step_noise has {step_noise.shape[1]} steps; this head samples in {S} and needs {S - 1}")
        if (record or alt is not None) and final_noise is None:
            raise ValueError("record=True and alt= need final_noise: a path without a last Gaussian step has no density")
        x = init_noise.to(z.dtype)
        if not record and alt is None:
            c_emb = self.cond_embedding(z, z_uncond)
            for col, i in enumerate(range(S - 1, 0, -1)):
                mean, std = self.gaussian_step(x, i, z, z_uncond, cfg, temperature, c_emb)
                x = (mean + std * step_noise[:, col].double()).to(z.dtype)
            mean, std = self.gaussian_step(x, 0, z, z_uncond, cfg, temperature, c_emb)
            sample = mean if final_noise is None else mean + std * final_noise.double()
            return HeadTrajectory(sample=sample.to(z.dtype), mean=mean, std=std)
        N = z.shape[0]
        rows = None
        if alt is not None:  # the alternative conditioning rides as extra rows of every head call
            rows, za, zua = alt
            z = torch.cat([z, za])
            z_uncond = None if z_uncond is None else torch.cat([z_uncond, zua])
            cfg = None if cfg is None else torch.cat([cfg, cfg[rows]])
        c_emb = self.cond_embedding(z, z_uncond)
        states, means, stds = [], [], []
        for col, i in enumerate(range(S, 0, -1)):
            states.append(x)
            xx = x if rows is None else torch.cat([x, x[rows]])
            mean, std = self.gaussian_step(xx, i - 1, z, z_uncond, cfg, temperature, c_emb)
            means.append(mean)
            stds.append(std)
            noise = step_noise[:, col] if i > 1 else final_noise
            x = (mean[:N] + std[:N] * noise.double()).to(z.dtype)  # the value the next step reads
        sample = x
        # densities of every step's output (cast to z's dtype, as read) in one pass at the end
        states = torch.stack(states, 1)  # [N, S, D]: each step's input
        out = torch.cat([states[:, 1:], sample[:, None]], 1).double()  # each step's output
        mean, std = torch.stack(means, 1), torch.stack(stds, 1)  # [N (+ M), S, D]
        log_density = _log_normal(out, mean[:N], std[:N]).sum(1)
        alt_log_density = None if rows is None else _log_normal(out[rows], mean[N:], std[N:]).sum(1)
        return HeadTrajectory(sample=sample, mean=means[-1][:N], std=stds[-1][:N], states=states,
                              log_density=log_density, alt_log_density=alt_log_density)

    # -- training ------------------------------------------------------------------------

    def loss(self, target: torch.Tensor, z: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Per-token loss [N]: eps MSE + the variational bound term for the learned variance
        (mean detached), as improved-DDPM's hybrid loss (`LossType.MSE` with learned range);
        the t = 0 term uses the Gaussian NLL of the target instead of the discretised one."""
        s = self.train_schedule
        N, D = target.shape
        dev = target.device
        t = draw(torch.randint, 0, s.num_steps, (N,), generator=generator, device=dev)
        noise = draw(torch.randn, target.shape, dtype=target.dtype, generator=generator, device=dev)
        g = lambda a: a.to(dev, target.dtype)[t][:, None]
        x_t = g(s.sqrt_ac) * target + g(s.sqrt_1m_ac) * noise
        out = self.net(x_t, t, z)
        eps, v = out[:, :D], out[:, D:]
        mse = ((eps - noise) ** 2).mean(-1)
        pred_x0 = g(s.sqrt_recip_ac) * x_t - g(s.sqrt_recipm1_ac) * eps.detach()
        mean_model = g(s.coef1) * pred_x0 + g(s.coef2) * x_t
        frac = (v + 1) / 2
        log_var = frac * g(s.max_log) + (1 - frac) * g(s.min_log)
        mean_true = g(s.coef1) * target + g(s.coef2) * x_t
        log_var_true = g(s.min_log)
        kl = 0.5 * (-1.0 + log_var - log_var_true + torch.exp(log_var_true - log_var)
                    + (mean_true - mean_model) ** 2 * torch.exp(-log_var))
        nll = 0.5 * (math.log(2 * math.pi) + log_var + (target - mean_model) ** 2 * torch.exp(-log_var))
        vb = torch.where((t == 0)[:, None], nll, kl).mean(-1) / math.log(2.0)
        return mse + vb * s.num_steps / 1000.0
