"""MAR model, diffusion head and KL-16 VAE: official layouts load strictly and reproduce an
independent reference written here from the official code's semantics (github.com/LTH14/mar:
models/mar.py, models/diffloss.py, diffusion/, models/vae.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mmspec.models.mar import MAR_VARIANTS, MARModel, mar_schedule
from mmspec.models.mar_diffloss import RespacedCosineSchedule

TINY = dict(img_size=16, vae_stride=4, patch_size=1, encoder_embed_dim=32, encoder_depth=2, encoder_num_heads=4,
            decoder_embed_dim=24, decoder_depth=1, decoder_num_heads=2, vae_embed_dim=4, class_num=7, buffer_size=3,
            diffloss_d=2, diffloss_w=20, num_sampling_steps=6)


def official_keys(c: dict) -> dict:
    """Key -> shape of the official MAR state dict, enumerated from the official module tree."""
    E, Dd, L = c["encoder_embed_dim"], c["decoder_embed_dim"], (c["img_size"] // c["vae_stride"] // c["patch_size"]) ** 2
    tok, buf, W = c["vae_embed_dim"] * c["patch_size"] ** 2, c["buffer_size"], c["diffloss_w"]
    keys = {"class_emb.weight": (c["class_num"], E), "fake_latent": (1, E), "z_proj.weight": (E, tok), "z_proj.bias": (E,),
            "z_proj_ln.weight": (E,), "z_proj_ln.bias": (E,), "encoder_pos_embed_learned": (1, L + buf, E),
            "encoder_norm.weight": (E,), "encoder_norm.bias": (E,), "decoder_embed.weight": (Dd, E),
            "decoder_embed.bias": (Dd,), "mask_token": (1, 1, Dd), "decoder_pos_embed_learned": (1, L + buf, Dd),
            "decoder_norm.weight": (Dd,), "decoder_norm.bias": (Dd,), "diffusion_pos_embed_learned": (1, L, Dd)}
    for side, dim, depth in (("encoder", E, c["encoder_depth"]), ("decoder", Dd, c["decoder_depth"])):
        for i in range(depth):
            p = f"{side}_blocks.{i}."
            keys.update({p + "norm1.weight": (dim,), p + "norm1.bias": (dim,), p + "attn.qkv.weight": (3 * dim, dim),
                         p + "attn.qkv.bias": (3 * dim,), p + "attn.proj.weight": (dim, dim), p + "attn.proj.bias": (dim,),
                         p + "norm2.weight": (dim,), p + "norm2.bias": (dim,), p + "mlp.fc1.weight": (4 * dim, dim),
                         p + "mlp.fc1.bias": (4 * dim,), p + "mlp.fc2.weight": (dim, 4 * dim), p + "mlp.fc2.bias": (dim,)})
    n = "diffloss.net."
    keys.update({n + "time_embed.mlp.0.weight": (W, 256), n + "time_embed.mlp.0.bias": (W,),
                 n + "time_embed.mlp.2.weight": (W, W), n + "time_embed.mlp.2.bias": (W,),
                 n + "cond_embed.weight": (W, Dd), n + "cond_embed.bias": (W,), n + "input_proj.weight": (W, tok),
                 n + "input_proj.bias": (W,), n + "final_layer.linear.weight": (2 * tok, W),
                 n + "final_layer.linear.bias": (2 * tok,), n + "final_layer.adaLN_modulation.1.weight": (2 * W, W),
                 n + "final_layer.adaLN_modulation.1.bias": (2 * W,)})
    for i in range(c["diffloss_d"]):
        p = f"{n}res_blocks.{i}."
        keys.update({p + "in_ln.weight": (W,), p + "in_ln.bias": (W,), p + "mlp.0.weight": (W, W), p + "mlp.0.bias": (W,),
                     p + "mlp.2.weight": (W, W), p + "mlp.2.bias": (W,), p + "adaLN_modulation.1.weight": (3 * W, W),
                     p + "adaLN_modulation.1.bias": (3 * W,)})
    return keys


def random_official_sd(c: dict, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: 0.3 * torch.randn(s, generator=g, dtype=torch.float64) + (1.0 if k.endswith("norm1.weight") else 0.0)
            for k, s in official_keys(c).items()}


# -- independent reference (official semantics) ---------------------------------------------


def ref_block(sd, p, x, heads):
    def ln(h, name):
        return F.layer_norm(h, h.shape[-1:], sd[name + ".weight"], sd[name + ".bias"], 1e-6)

    B, N, C = x.shape
    h = ln(x, p + "norm1")
    qkv = (h @ sd[p + "attn.qkv.weight"].T + sd[p + "attn.qkv.bias"]).reshape(B, N, 3, heads, C // heads)
    q, k, v = qkv.unbind(2)
    att = torch.einsum("bnhd,bmhd->bhnm", q, k) / math.sqrt(C // heads)
    o = torch.einsum("bhnm,bmhd->bnhd", att.softmax(-1), v).reshape(B, N, C)
    x = x + o @ sd[p + "attn.proj.weight"].T + sd[p + "attn.proj.bias"]
    h = ln(x, p + "norm2")
    h = F.gelu(h @ sd[p + "mlp.fc1.weight"].T + sd[p + "mlp.fc1.bias"])
    return x + h @ sd[p + "mlp.fc2.weight"].T + sd[p + "mlp.fc2.bias"]


def ref_forward_z(sd, c, tokens, mask, class_embedding):
    """Official forward_mae_encoder + forward_mae_decoder (eval); mask [B, L] 1 = unknown,
    every row with the same number of unknown tokens (as the official code requires)."""
    buf = c["buffer_size"]
    ln = lambda h, n: F.layer_norm(h, h.shape[-1:], sd[n + ".weight"], sd[n + ".bias"], 1e-6)
    x = tokens @ sd["z_proj.weight"].T + sd["z_proj.bias"]
    B, L, E = x.shape
    x = torch.cat([torch.zeros(B, buf, E, dtype=x.dtype), x], 1)
    mwb = torch.cat([torch.zeros(B, buf), mask], 1)
    x[:, :buf] = class_embedding.unsqueeze(1)
    x = ln(x + sd["encoder_pos_embed_learned"], "z_proj_ln")
    x = x[(1 - mwb).nonzero(as_tuple=True)].reshape(B, -1, E)
    for i in range(c["encoder_depth"]):
        x = ref_block(sd, f"encoder_blocks.{i}.", x, c["encoder_num_heads"])
    x = ln(x, "encoder_norm")
    x = x @ sd["decoder_embed.weight"].T + sd["decoder_embed.bias"]
    pad = sd["mask_token"].repeat(B, mwb.shape[1], 1).clone()
    pad[(1 - mwb).nonzero(as_tuple=True)] = x.reshape(-1, x.shape[-1])
    x = pad + sd["decoder_pos_embed_learned"]
    for i in range(c["decoder_depth"]):
        x = ref_block(sd, f"decoder_blocks.{i}.", x, c["decoder_num_heads"])
    return ln(x, "decoder_norm")[:, buf:] + sd["diffusion_pos_embed_learned"]


def ref_net(sd, c, x, t, z):
    """Official SimpleMLPAdaLN forward."""
    n = "diffloss.net."
    lin = lambda h, k: h @ sd[n + k + ".weight"].T + sd[n + k + ".bias"]
    half = 128
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    temb = torch.cat([torch.cos(args), torch.sin(args)], -1).double()
    y = lin(F.silu(lin(temb, "time_embed.mlp.0")), "time_embed.mlp.2") + lin(z, "cond_embed")
    h = lin(x, "input_proj")
    for i in range(c["diffloss_d"]):
        p = f"res_blocks.{i}."
        sh, sc, gate = lin(F.silu(y), p + "adaLN_modulation.1").chunk(3, -1)
        u = F.layer_norm(h, h.shape[-1:], sd[n + p + "in_ln.weight"], sd[n + p + "in_ln.bias"], 1e-6) * (1 + sc) + sh
        h = h + gate * lin(F.silu(lin(u, p + "mlp.0")), p + "mlp.2")
    sh, sc = lin(F.silu(y), "final_layer.adaLN_modulation.1").chunk(2, -1)
    return lin(F.layer_norm(h, h.shape[-1:], eps=1e-6) * (1 + sc) + sh, "final_layer.linear")


def ref_schedule(steps: int):
    """improved-diffusion: cosine betas, space_timesteps(1000, [steps]), respaced posterior."""
    ab = lambda t: math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
    betas = np.array([min(1 - ab((i + 1) / 1000) / ab(i / 1000), 0.999) for i in range(1000)])
    frac = 999 / (steps - 1) if steps > 1 else 1
    use, cur = set(), 0.0
    for _ in range(steps):  # improved-diffusion's respace.py: the stride accumulated, then rounded
        use.add(round(cur))
        cur += frac
    last, new_b, tmap = 1.0, [], []
    for i, a in enumerate(np.cumprod(1 - betas)):
        if i in use:
            new_b.append(1 - a / last)
            last = a
            tmap.append(i)
    b = np.array(new_b)
    ac = np.cumprod(1 - b)
    acp = np.append(1.0, ac[:-1])
    pv = b * (1 - acp) / (1 - ac)
    return dict(tmap=tmap, betas=b, ac=ac, plvc=np.log(np.append(pv[1], pv[1:])),
                c1=b * np.sqrt(acp) / (1 - ac), c2=(1 - acp) * np.sqrt(1 - b) / (1 - ac))


def ref_p_sample_loop(sd, c, z, noise, step_noises, temperature, cfg=None, z_u=None, clip=None):
    """Official p_sample_loop (learned range, eps prediction, no noise at t = 0)."""
    s = ref_schedule(c["num_sampling_steps"])
    x, D = noise, noise.shape[1]
    for col, i in enumerate(reversed(range(len(s["tmap"])))):
        t = torch.full((x.shape[0],), s["tmap"][i])
        out = ref_net(sd, c, x, t, z)
        eps, v = out[:, :D], out[:, D:]
        if cfg is not None:
            eps = ref_net(sd, c, x, t, z_u)[:, :D] + cfg * (eps - ref_net(sd, c, x, t, z_u)[:, :D])
        x0 = math.sqrt(1 / s["ac"][i]) * x - math.sqrt(1 / s["ac"][i] - 1) * eps
        if clip is not None:
            x0 = x0.clamp(-clip, clip)
        mean = s["c1"][i] * x0 + s["c2"][i] * x
        fr = (v + 1) / 2
        logv = fr * math.log(s["betas"][i]) + (1 - fr) * s["plvc"][i]
        x = mean + (torch.exp(0.5 * logv) * step_noises[:, col] * temperature if i > 0 else 0)
    return x


# -- tests ----------------------------------------------------------------------------------


def test_schedule_matches_reference_and_diffusers_betas():
    from diffusers import DDPMScheduler

    from mmspec.models.mar_diffloss import cosine_betas

    d = DDPMScheduler(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2").betas.double()
    assert torch.allclose(cosine_betas(1000), d, rtol=1e-6, atol=1e-9)  # diffusers keeps float32
    with pytest.raises(ValueError, match="num_sampling_steps"):
        RespacedCosineSchedule(1)
    # what improved-diffusion's respace.py keeps for 21 steps: 450 is followed by 499
    assert RespacedCosineSchedule(21).timestep_map.tolist()[9:12] == [450, 499, 549]
    for steps in (2, 6, 21, 23, 100):  # 21 / 23: the accumulated stride rounds otherwise than i * stride
        ref, s = ref_schedule(steps), RespacedCosineSchedule(steps)
        assert s.timestep_map.tolist() == ref["tmap"]
        for mine, theirs in ((s.betas, "betas"), (s.min_log, "plvc"), (s.coef1, "c1"), (s.coef2, "c2")):
            assert np.allclose(mine.numpy(), ref[theirs], rtol=1e-12, atol=0), theirs


def test_official_layout_loads_strictly():
    sd = random_official_sd(TINY)
    model = MARModel(**TINY)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == official_keys(TINY)
    m = MARModel.from_official({"model": random_official_sd(TINY, 1), "model_ema": sd, "epoch": 3}, **TINY)
    assert all(torch.equal(m.state_dict()[k], v) for k, v in sd.items())
    assert MARModel.from_official({"model_ema": sd}, torch_dtype=torch.float32, **TINY).dtype == torch.float32


class _Pickled:  # stands for any Python object a checkpoint file could carry
    pass


def test_official_checkpoint_file_loads_weights_only(tmp_path):
    # MAR's misc.save_model writes model, model_ema, optimizer, epoch, scaler and the argparse args
    import argparse

    from mmspec.models.kl16 import load_kl16

    sd = random_official_sd(TINY)
    model = MARModel(**TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sum(p.sum() for p in model.parameters()).backward()
    opt.step()  # optimizer state with tensors, as in a real file
    path = tmp_path / "checkpoint-last.pth"
    torch.save({"model": random_official_sd(TINY, 1), "model_ema": sd, "optimizer": opt.state_dict(), "epoch": 3,
                "scaler": {"scale": 65536.0, "_growth_tracker": 0}, "args": argparse.Namespace(model="mar_base")}, path)
    m = MARModel.from_official(str(path), **TINY)
    assert all(torch.equal(m.state_dict()[k], v) for k, v in sd.items())
    with pytest.raises(ValueError, match="no 'model_ema' weights.*None.*use_ema=False"):
        MARModel.from_official({"model": sd, "model_ema": None, "epoch": 3}, **TINY)  # saved without EMA
    bad = tmp_path / "other.pth"
    torch.save({"model_ema": sd, "extra": _Pickled()}, bad)
    for load in (lambda: MARModel.from_official(str(bad), **TINY), lambda: load_kl16(str(bad))):
        with pytest.raises(ValueError, match="Python objects besides tensors.*if you trust the file"):
            load()


@pytest.mark.parametrize("variant,millions", [("mar_base", 208), ("mar_large", 479), ("mar_huge", 943)])
def test_variants_match_official_parameter_counts(variant, millions):
    # official README: MAR-B 208M, MAR-L 479M, MAR-H 943M parameters (rounded up)
    with torch.device("meta"):
        m = MARModel(**MAR_VARIANTS[variant])
    assert math.ceil(sum(p.numel() for p in m.parameters()) / 1e6) == millions
    full = dict(img_size=256, vae_stride=16, patch_size=1, vae_embed_dim=16, class_num=1000, buffer_size=64,
                **MAR_VARIANTS[variant])
    assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == official_keys(full)


def test_wrong_architecture_is_refused_naming_keys():
    sd = random_official_sd(TINY)
    with pytest.raises(ValueError, match="shape mismatches.*encoder_pos_embed"):
        MARModel.from_official({"model_ema": sd}, **{**TINY, "buffer_size": 5})
    with pytest.raises(ValueError, match="missing keys.*encoder_blocks.2"):
        MARModel.from_official({"model_ema": sd}, **{**TINY, "encoder_depth": 3})
    sd2 = dict(sd)
    sd2["diffloss.net.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="unexpected keys.*diffloss.net.extra"):
        MARModel.from_official({"model_ema": sd2}, **TINY)
    with pytest.raises(ValueError, match="use_ema=False"):
        MARModel.from_official({"model": sd}, **TINY)
    with pytest.raises(ValueError, match="variant"):
        MARModel.from_official({"model": sd}, "mar_tiny")


def test_forward_matches_reference_including_ragged_rows():
    sd = random_official_sd(TINY)
    m = MARModel.from_official({"model_ema": sd}, **TINY).double()
    g = torch.Generator().manual_seed(0)
    B, L, D = 3, m.seq_len, m.token_embed_dim
    tokens = torch.randn(B, L, D, generator=g, dtype=torch.float64)
    labels = torch.tensor([0, 4, 6])
    emb = sd["class_emb.weight"][labels]
    orders = torch.rand(B, L, generator=g).argsort(1)
    for n_unknown in (L, 9, 1):
        mask = torch.zeros(B, L)
        mask.scatter_(1, orders[:, :n_unknown], 1.0)
        ref = ref_forward_z(sd, TINY, tokens, mask, emb)
        got = m.forward_z(tokens, mask == 0, m.class_embedding(labels, B))
        assert torch.allclose(got, ref, atol=1e-10), n_unknown
    # rows with different numbers of known tokens in one batch == each row alone
    mask = torch.zeros(B, L)
    for b, n in enumerate((L, 9, 2)):
        mask[b, orders[b, :n]] = 1.0
    got = m.forward_z(tokens, mask == 0, m.class_embedding(labels, B))
    for b in range(B):
        ref = ref_forward_z(sd, TINY, tokens[b:b + 1], mask[b:b + 1], emb[b:b + 1])
        assert torch.allclose(got[b:b + 1], ref, atol=1e-10)
    unc = ref_forward_z(sd, TINY, tokens, mask * 0 + 1, sd["fake_latent"].expand(B, -1))
    assert torch.allclose(m.forward_z(tokens, mask * 0 + 1 == 0, m.class_embedding(None, B)), unc, atol=1e-10)



def test_forward_at_wanted_positions_equals_the_full_forward_and_is_nan_elsewhere():
    sd = random_official_sd(TINY)
    m = MARModel.from_official({"model_ema": sd}, **TINY).double()
    g = torch.Generator().manual_seed(3)
    B, L, D = 3, m.seq_len, m.token_embed_dim
    tokens = torch.randn(B, L, D, generator=g, dtype=torch.float64)
    known = torch.rand(B, L, generator=g) < torch.tensor([[0.0], [0.5], [0.9]])  # ragged rows
    emb = m.class_embedding(torch.tensor([0, 4, 6]), B)
    full = m.forward_z(tokens, known, emb)
    need = torch.zeros(B, L, dtype=torch.bool)
    need[0, [1, 5, 7]] = True  # rows want different numbers of positions, one row none
    need[1, 2] = True
    got = m.forward_z(tokens, known, emb, need=need)
    assert torch.allclose(got[need], full[need], atol=1e-12, rtol=0)
    assert got[~need].isnan().all()
    assert m.forward_z(tokens, known, emb, need=torch.zeros(B, L, dtype=torch.bool)).isnan().all()
    with pytest.raises(ValueError, match="need must be"):
        m.forward_z(tokens, known, emb, need=need[:, :-1])

def test_head_matches_official_sampler_with_and_without_cfg():
    sd = random_official_sd(TINY)
    m = MARModel.from_official({"model_ema": sd}, **TINY).double()
    g = torch.Generator().manual_seed(1)
    N, D, S = 5, m.token_embed_dim, TINY["num_sampling_steps"]
    z, zu = torch.randn(N, 24, generator=g, dtype=torch.float64), torch.randn(N, 24, generator=g, dtype=torch.float64)
    x_T = torch.randn(N, D, generator=g, dtype=torch.float64)
    steps = torch.randn(N, S - 1, D, generator=g, dtype=torch.float64)
    ref = ref_p_sample_loop(sd, TINY, z, x_T, steps, 0.7)
    got = m.diffloss.trajectory(z, x_T, steps, None, temperature=0.7)
    assert torch.allclose(got.sample, ref, atol=1e-10)
    assert torch.allclose(got.mean, ref, atol=1e-10)  # no noise at t = 0: the sample is the mean
    cfg = torch.full((N,), 2.5, dtype=torch.float64)
    ref = ref_p_sample_loop(sd, TINY, z, x_T, steps, 1.0, cfg=2.5, z_u=zu)
    got = m.diffloss.trajectory(z, x_T, steps, None, z_uncond=zu, cfg=cfg)
    assert torch.allclose(got.sample, ref, atol=1e-10)
    clipped = MARModel.from_official({"model_ema": sd}, **TINY, diffloss_clip_x0=0.5).double()
    ref_c = ref_p_sample_loop(sd, TINY, z, x_T, steps, 0.7, clip=0.5)
    gc = clipped.diffloss.trajectory(z, x_T, steps, None, temperature=0.7)
    assert torch.allclose(gc.sample, ref_c, atol=1e-10) and not torch.allclose(gc.sample, m.diffloss.trajectory(
        z, x_T, steps, None, temperature=0.7).sample)
    fin = torch.randn(N, D, generator=g, dtype=torch.float64)
    noisy = m.diffloss.trajectory(z, x_T, steps, fin, z_uncond=zu, cfg=cfg)
    assert torch.allclose(noisy.sample, got.mean + got.std * fin, atol=1e-12) and (noisy.std > 0).all()


def ref_sample_tokens(sd, c, labels, num_iter, cfg, temperature, orders, init, steps_noise):
    """Official MAR.sample_tokens (cfg_schedule='linear'), with the diffusion noise of token
    (b, p) taken from init[b, p] / steps_noise[b, p] instead of fresh draws."""
    bsz, L = orders.shape
    D = init.shape[-1]
    mask = torch.ones(bsz, L)
    tokens = torch.zeros(bsz, L, D, dtype=torch.float64)
    for step in range(num_iter):
        cur = tokens.clone()
        emb = sd["class_emb.weight"][labels]
        tk, ms = tokens, mask
        if cfg != 1.0:
            tk, ms = torch.cat([tokens, tokens]), torch.cat([mask, mask])
            emb = torch.cat([emb, sd["fake_latent"].expand(bsz, -1)])
        z = ref_forward_z(sd, c, tk, ms, emb)
        mask_len = np.floor(L * np.cos(math.pi / 2.0 * (step + 1) / num_iter))
        mask_len = max(1.0, min(float(mask[0].sum()) - 1, mask_len))
        mask_next = torch.zeros(bsz, L)
        mask_next.scatter_(1, orders[:, :int(mask_len)], 1.0)
        to_pred = mask.bool() if step >= num_iter - 1 else torch.logical_xor(mask.bool(), mask_next.bool())
        mask = mask_next
        rows, pos = to_pred.nonzero(as_tuple=True)
        cfg_iter = 1 + (cfg - 1) * (L - mask_len) / L
        if cfg != 1.0:
            zc, zu = z.chunk(2)
            x = ref_p_sample_loop(sd, c, zc[rows, pos], init[rows, pos], steps_noise[rows, pos], temperature,
                                  cfg=cfg_iter, z_u=zu[rows, pos])
        else:
            x = ref_p_sample_loop(sd, c, z[rows, pos], init[rows, pos], steps_noise[rows, pos], temperature)
        cur[rows, pos] = x
        tokens = cur
    return tokens


@pytest.mark.parametrize("num_iter,cfg", [(4, 1.0), (5, 3.0), (16, 2.0)])
def test_plain_sampling_matches_official_sample_tokens(num_iter, cfg):
    from mmspec.pipelines.cspd import draw_noise, sample_mar

    sd = random_official_sd(TINY, 2)
    m = MARModel.from_official({"model_ema": sd}, **TINY).double()
    labels = torch.tensor([1, 5])
    tokens, stats = sample_mar(m, labels, num_iter=num_iter, guidance_scale=cfg, temperature=0.9, final_step_noise=False,
                               generator=torch.Generator().manual_seed(7))
    n = draw_noise(2, m.seq_len, m.token_embed_dim, 6, torch.Generator().manual_seed(7), "cpu", torch.float64)
    ref = ref_sample_tokens(sd, TINY, labels, num_iter, cfg, 0.9, n.orders, n.init, n.steps)
    assert torch.allclose(tokens, ref, atol=1e-9)
    assert stats.spec.target_calls == num_iter


def test_mar_schedule_bounds():
    masked, lens = mar_schedule(16, 5)
    assert masked[0] == 16 and masked[-1] == 0 and all(a > b for a, b in zip(masked, masked[1:]))
    assert mar_schedule(16, 16)[0] == list(range(16, -1, -1))
    for bad in (0, 17, 2.0):
        with pytest.raises(ValueError, match="num_iter"):
            mar_schedule(16, bad)


# -- KL-16 ----------------------------------------------------------------------------------


class _RefResnet(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(32, cin, eps=1e-6), nn.Conv2d(cin, cout, 3, 1, 1)
        self.norm2, self.conv2 = nn.GroupNorm(32, cout, eps=1e-6), nn.Conv2d(cout, cout, 3, 1, 1)
        if cin != cout:
            self.nin_shortcut = nn.Conv2d(cin, cout, 1)

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x) + h


class _RefAttn(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm = nn.GroupNorm(32, c, eps=1e-6)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(c, c, 1) for _ in range(4))

    def forward(self, x):
        h = self.norm(x)
        B, C, H, W = x.shape
        q, k, v = (f(h).reshape(B, C, H * W) for f in (self.q, self.k, self.v))
        w = (torch.einsum("bci,bcj->bij", q, k) * C ** -0.5).softmax(-1)
        return x + self.proj_out(torch.einsum("bij,bcj->bci", w, v).reshape(B, C, H, W))


class _RefLevel(nn.Module):
    pass


class RefKLVAE(nn.Module):
    """latent-diffusion Encoder / Decoder with the official names (ch_mult, 1 level of encoder
    attention at `attn_res`, none in the decoder but the mid blocks)."""

    def __init__(self, ch=32, ch_mult=(1, 2), z=4, nres=1, resolution=32, attn_res=(16,)):
        super().__init__()
        self.encoder, self.decoder = nn.Module(), nn.Module()
        e, d = self.encoder, self.decoder
        e.conv_in = nn.Conv2d(3, ch, 3, 1, 1)
        e.down = nn.ModuleList()
        cin, res = ch, resolution
        for i, m in enumerate(ch_mult):
            lvl = _RefLevel()
            lvl.block, lvl.attn = nn.ModuleList(), nn.ModuleList()
            for _ in range(nres):
                lvl.block.append(_RefResnet(cin, ch * m))
                cin = ch * m
                if res in attn_res:
                    lvl.attn.append(_RefAttn(cin))
            if i != len(ch_mult) - 1:
                lvl.downsample = nn.Module()
                lvl.downsample.conv = nn.Conv2d(cin, cin, 3, 2, 0)
                res //= 2
            e.down.append(lvl)
        e.mid = nn.Module()
        e.mid.block_1, e.mid.attn_1, e.mid.block_2 = _RefResnet(cin, cin), _RefAttn(cin), _RefResnet(cin, cin)
        e.norm_out, e.conv_out = nn.GroupNorm(32, cin, eps=1e-6), nn.Conv2d(cin, 2 * z, 3, 1, 1)
        self.quant_conv, self.post_quant_conv = nn.Conv2d(2 * z, 2 * z, 1), nn.Conv2d(z, z, 1)
        d.conv_in = nn.Conv2d(z, cin, 3, 1, 1)
        d.mid = nn.Module()
        d.mid.block_1, d.mid.attn_1, d.mid.block_2 = _RefResnet(cin, cin), _RefAttn(cin), _RefResnet(cin, cin)
        ups = []
        for i in reversed(range(len(ch_mult))):
            lvl = _RefLevel()
            lvl.block, lvl.attn = nn.ModuleList(), nn.ModuleList()
            for _ in range(nres + 1):
                lvl.block.append(_RefResnet(cin, ch * ch_mult[i]))
                cin = ch * ch_mult[i]
            if i != 0:
                lvl.upsample = nn.Module()
                lvl.upsample.conv = nn.Conv2d(cin, cin, 3, 1, 1)
            ups.insert(0, lvl)
        d.up = nn.ModuleList(ups)
        d.norm_out, d.conv_out = nn.GroupNorm(32, cin, eps=1e-6), nn.Conv2d(cin, 3, 3, 1, 1)

    def encode_moments(self, x):
        e = self.encoder
        h = e.conv_in(x)
        for lvl in e.down:
            for j, blk in enumerate(lvl.block):
                h = blk(h)
                if len(lvl.attn):
                    h = lvl.attn[j](h)
            if hasattr(lvl, "downsample"):
                h = lvl.downsample.conv(F.pad(h, (0, 1, 0, 1)))
        h = e.mid.block_2(e.mid.attn_1(e.mid.block_1(h)))
        return self.quant_conv(e.conv_out(F.silu(e.norm_out(h))))

    def decode(self, z):
        d = self.decoder
        h = d.conv_in(self.post_quant_conv(z))
        h = d.mid.block_2(d.mid.attn_1(d.mid.block_1(h)))
        for lvl in reversed(d.up):
            for blk in lvl.block:
                h = blk(h)
            if hasattr(lvl, "upsample"):
                h = lvl.upsample.conv(F.interpolate(h, scale_factor=2.0, mode="nearest"))
        return d.conv_out(F.silu(d.norm_out(h)))


def test_kl16_converter_loads_official_layout_and_matches_reference(tmp_path):
    from mmspec.models.kl16 import KL16_SCALING_FACTOR, kl16_autoencoder_kwargs, load_kl16

    torch.manual_seed(0)
    ref = RefKLVAE().double().eval()
    for p in ref.parameters():
        p.data.add_(0.05 * torch.randn_like(p))
    path = tmp_path / "kl16.ckpt"
    sd = ref.state_dict()
    assert any(".attn.0.q.weight" in k for k in sd)  # encoder attention exercised
    torch.save({"model": {**sd, "loss.logvar": torch.zeros(())}}, path)
    cfg = dict(ch=32, ch_mult=(1, 2), embed_dim=4, num_res_blocks=1, resolution=32, encoder_attn_resolutions=(16,))
    vae = load_kl16(str(path), **cfg).double()
    assert vae.config.scaling_factor == KL16_SCALING_FACTOR
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        moments = ref.encode_moments(x)
        mean = vae.encode(x).latent_dist.mean
        assert torch.allclose(mean, moments[:, :4], atol=1e-9)
        z = torch.randn(2, 4, 16, 16, dtype=torch.float64)
        assert torch.allclose(vae.decode(z).sample, ref.decode(z), atol=1e-9)
    assert kl16_autoencoder_kwargs()["down_block_types"][-1] == "AttnDownEncoderBlock2D"
    assert kl16_autoencoder_kwargs()["down_block_types"][:4] == ("DownEncoderBlock2D",) * 4
    with pytest.raises(ValueError, match="missing keys.*decoder.up_blocks"):
        load_kl16({"model": sd}, **{**cfg, "ch_mult": (1, 2, 2)})


def test_num_sampling_steps_is_an_int_or_its_digits():
    """The constructor truncated a float (100.7 ran 100 steps, the config said 100.7) and the
    official "ddimN" respacing strings failed inside int(); the official code takes a string of
    digits, which is honoured."""
    from test_mar_cspd import tiny_mar

    assert tiny_mar(num_sampling_steps="25").diffloss.num_sampling_steps == 25
    for bad, message in [(100.7, r"got 100\.7$"), ("ddim50", r"'ddimN' and comma-separated respacings are not "
                                                             r"supported"), ("10,20", "comma-separated"), (1, "got 1$"),
                         (True, "got True")]:
        with pytest.raises(ValueError, match=r"num_sampling_steps must be an int in \[2, 1000\].*" + message):
            tiny_mar(num_sampling_steps=bad)
    model = tiny_mar()
    with pytest.raises(ValueError, match="ddimN"):
        model.set_num_sampling_steps("ddim25")
    assert model.set_num_sampling_steps("30").diffloss.num_sampling_steps == 30


def test_num_sampling_steps_given_as_digits_is_stored_as_an_int(tmp_path):
    from test_mar_cspd import tiny_mar

    model = tiny_mar(num_sampling_steps="25")
    assert model.config.num_sampling_steps == 25  # ("25" was kept in the config as given)
