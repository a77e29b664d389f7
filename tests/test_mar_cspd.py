"""CSpD speculative sampling for MAR (pipelines/cspd.py) and SpeculativeMARPipeline:
drafter == target reproduces plain sampling, the sampled distribution matches plain sampling
(KS, with a planted bug that must fail), bad inputs are refused, save / load round trip."""

from __future__ import annotations

import copy

import pytest
import torch

from mmspec.models.mar import MARModel
from mmspec.models.mar_diffloss import DiffLoss
from mmspec.pipelines.cspd import MARNoise, draw_noise, sample_mar

TINY = dict(img_size=16, vae_stride=4, patch_size=1, encoder_embed_dim=32, encoder_depth=1, encoder_num_heads=2,
            decoder_embed_dim=32, decoder_depth=1, decoder_num_heads=2, vae_embed_dim=4, class_num=5, buffer_size=4,
            diffloss_d=1, diffloss_w=32, num_sampling_steps=5)


def tiny_mar(seed=0, dtype=torch.float64, **over):
    torch.manual_seed(seed)
    m = MARModel(**{**TINY, **over}).to(dtype).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():  # the default init zeroes the head's output layers
            if "adaLN" in n or "final_layer" in n:
                p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return m


class GaussianHead(DiffLoss):
    """Bayes-optimal eps for data N(W z, s^2 I) at every noise level (variance logits 0): a
    well-conditioned head, so a slightly perturbed drafter gets a moderate acceptance rate."""

    def __init__(self, base: DiffLoss, W: torch.Tensor, s: float = 0.5):
        super().__init__(base.in_channels, W.shape[1], 1, 8, base.num_sampling_steps)
        self.W, self.s2 = W, s * s

    def cond_embedding(self, z, z_uncond=None):
        return None

    def _path_model_out(self, x, t_steps, z, z_uncond, cfg):  # paths of S steps, flattened path-major
        S = t_steps.shape[0]
        rep = lambda a: None if a is None else a.repeat_interleave(S, 0)
        return self._model_out(x, t_steps.repeat(z.shape[0]), rep(z), rep(z_uncond), rep(cfg))

    def _model_out(self, x, t_orig, z, z_uncond, cfg, c_emb=None):  # t per row
        ac = self.train_schedule.alphas_cumprod.to(x.dtype)[t_orig][:, None]
        m = z @ self.W
        if z_uncond is not None:
            m = z_uncond @ self.W + cfg[:, None] * (m - z_uncond @ self.W)
        eps = (1 - ac).sqrt() * (x - ac.sqrt() * m) / (ac * self.s2 + 1 - ac)
        return eps, torch.zeros_like(x)


def test_drafter_equal_to_target_accepts_everything_and_equals_plain():
    m = tiny_mar()
    labels = torch.tensor([0, 3, 4, 1])
    plain, st0 = sample_mar(m, labels, num_iter=7, guidance_scale=2.0, generator=torch.Generator().manual_seed(1))
    spec, st = sample_mar(m, labels, num_iter=7, guidance_scale=2.0, drafter=m, num_draft_steps=3,
                          prefill_fraction=0.2, generator=torch.Generator().manual_seed(1))
    assert st.drafted_tokens > 0 and st.accepted_tokens == st.judged_tokens == st.drafted_tokens
    assert st.fallbacks == 0 and st.residual_tokens == 0
    assert torch.allclose(spec, plain, atol=1e-8, rtol=0)
    assert st.spec.target_calls < st0.spec.target_calls == 7  # 2 prefill + 2 verify rounds
    assert st.spec.draft_calls > 0 and st0.spec.draft_calls == 0


def test_every_token_of_a_speculative_run_is_counted_once():
    """Drafts accepted, residual samples and the target's own samples (bonus tokens) add up to the
    tokens decoded; bonus_steps counts row steps, bonus_tokens tokens, in both drafting modes (the
    self-drafting sampler counted tokens as bonus_steps)."""
    from mmspec.pipelines.cspd_self import sample_mar_self

    m, labels = tiny_mar(), torch.tensor([0, 3, 4, 1])
    L = sample_mar(m, labels[:1], num_iter=2, generator=torch.Generator().manual_seed(0))[0].shape[1]
    for drafter, prefill in ((m, 0.0), (tiny_mar(seed=1), 0.0), (tiny_mar(seed=1), 0.15)):  # 0.15: the default
        _, st = sample_mar(m, labels, num_iter=8, drafter=drafter, num_draft_steps=2, prefill_fraction=prefill,
                           generator=torch.Generator().manual_seed(1))
        assert st.accepted_tokens + st.residual_tokens + st.bonus_tokens == 4 * L, st
        if prefill == 0:  # (the prefill's plain samples are bonus tokens without bonus steps)
            assert (st.bonus_tokens > 0) == (st.bonus_steps > 0) and st.bonus_steps <= st.rounds * 4
        assert st.target_forwards_per_image == st.row_forwards / 4 <= st.spec.target_calls
    assert st.accepted_tokens == 0 < st.residual_tokens  # the second drafter is rejected: the count can fail
    _, st = sample_mar_self(m, labels, num_iter=8, num_draft_steps=2, generator=torch.Generator().manual_seed(1))
    assert st.accepted_tokens + st.residual_tokens + st.bonus_tokens == 4 * L and st.bonus_steps == 0, st
    # Rows waiting on a residual sit verify forwards out: per image, fewer than the batch's calls.
    assert st.row_forwards <= 4 * st.spec.target_calls and st.target_forwards_per_image == st.row_forwards / 4
    _, plain = sample_mar(m, labels, num_iter=8, generator=torch.Generator().manual_seed(1))
    assert plain.target_forwards_per_image == plain.spec.target_calls == 8 and plain.bonus_tokens == 4 * L


def _shared_noise(n_rows, L, D, S, seed_traj, seed_final):
    """Same order / x_T / step noise in every row, own last-step noise per row: the rows are
    i.i.d. draws of the token map given one trajectory noise, so the last-step Gaussian and
    its verification decide the distribution (a marginal test would hide them)."""
    base = draw_noise(1, L, D, S, torch.Generator().manual_seed(seed_traj), "cpu", torch.float64)
    fin = torch.randn(n_rows, L, D, generator=torch.Generator().manual_seed(seed_final), dtype=torch.float64)
    return MARNoise(base.orders.expand(n_rows, L), base.init.expand(n_rows, L, D),
                    base.steps.expand(n_rows, L, S - 1, D), fin)


def _ks_setup(drafter_steps=4):
    cfg = dict(img_size=12, vae_stride=4, vae_embed_dim=2, num_sampling_steps=4, class_num=3)
    target = tiny_mar(1, **cfg)
    W = torch.randn(32, 2, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 0.3
    target.diffloss = GaussianHead(target.diffloss, W)
    drafter = copy.deepcopy(target)
    drafter.diffloss = GaussianHead(target.diffloss, W + 0.002 * torch.randn(32, 2, generator=torch.Generator().manual_seed(3),
                                                                            dtype=torch.float64))
    drafter.set_num_sampling_steps(drafter_steps)
    return target, drafter


def _ks_run(drafter_final_noise: bool, n=1500, drafter_steps=4):
    from scipy.stats import ks_2samp

    import mmspec.pipelines.cspd as cspd

    target, drafter = _ks_setup(drafter_steps)
    L, D, S = target.seq_len, 2, 4
    labels = torch.full((n,), 2, dtype=torch.long)
    plain, _ = sample_mar(target, labels, num_iter=3, guidance_scale=1.5, noise=_shared_noise(n, L, D, S, 0, 1))
    orig = cspd._Predictor.__init__

    def planted(self, model, *a, **k):  # the bug: the drafter's last step adds no noise
        orig(self, model, *a, **k)
        if model is drafter and not drafter_final_noise:
            self.final_noise = False

    cspd._Predictor.__init__ = planted
    try:
        spec, st = sample_mar(target, labels, num_iter=3, guidance_scale=1.5, drafter=drafter, num_draft_steps=2,
                              prefill_fraction=0.0, noise=_shared_noise(n, L, D, S, 0, 2),
                              generator=torch.Generator().manual_seed(4))
    finally:
        cspd._Predictor.__init__ = orig
    pvals = [ks_2samp(plain[:, l, j].numpy(), spec[:, l, j].numpy()).pvalue for l in range(L) for j in range(D)]
    return min(pvals), len(pvals), st


def test_token_distribution_matches_plain_sampling_ks():
    p_min, k, st = _ks_run(drafter_final_noise=True)
    # acceptance must be neither ~0 nor ~1, else the test would not exercise accept and residual
    assert 0.2 < st.acceptance_rate < 0.9, st.summary()
    assert st.residual_tokens > 1000 and st.fallbacks < 0.01 * st.residual_tokens
    assert 0 < st.bonus_steps < st.rounds * st.images  # some rows took the bonus step, others stopped earlier
    assert p_min > 0.01 / k, (p_min, st.summary())  # Bonferroni over the k position x dimension tests


def test_drafter_with_fewer_head_steps_stays_exact():
    # the drafter samples its head in 2 steps, the target in 4: a cheaper draft, the same law
    # (its trajectory is no longer aligned with the target's, so the exact rule rejects its
    # tokens here and the residual carries the law)
    p_min, k, st = _ks_run(drafter_final_noise=True, drafter_steps=2)
    assert st.drafted_tokens > 0 and st.residual_tokens > 1000, st.summary()
    assert p_min > 0.01 / k, (p_min, st.summary())


def test_ks_has_power_against_missing_final_noise():
    p_min, k, st = _ks_run(drafter_final_noise=False)
    assert p_min < 0.01 / k, (p_min, st.summary())


def test_tiny_std_gives_no_nan():
    m = tiny_mar()
    d = tiny_mar(seed=5)
    labels = torch.tensor([0, 1, 2])
    for temperature in (1e-6, 1e-30):
        out, st = sample_mar(m, labels, num_iter=4, guidance_scale=3.0, temperature=temperature, drafter=d,
                             num_draft_steps=2, generator=torch.Generator().manual_seed(0))
        assert torch.isfinite(out).all(), temperature
    m32, d32 = tiny_mar(dtype=torch.float32), tiny_mar(seed=5, dtype=torch.float32)
    out, _ = sample_mar(m32, labels, num_iter=4, temperature=1e-6, drafter=d32, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(out).all()


def test_bad_inputs_are_refused_naming_the_argument():
    m = tiny_mar()
    ok = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="class_labels"):
        sample_mar(m, torch.tensor([0, 5]), num_iter=4)
    with pytest.raises(ValueError, match="class_labels"):
        sample_mar(m, torch.tensor([-1]), num_iter=4)
    for bad in (0, 17):
        with pytest.raises(ValueError, match="num_iter"):
            sample_mar(m, ok, num_iter=bad)
    with pytest.raises(ValueError, match="drafter token_embed_dim"):
        sample_mar(m, ok, num_iter=4, drafter=tiny_mar(vae_embed_dim=3))
    with pytest.raises(ValueError, match="drafter seq_len"):
        sample_mar(m, ok, num_iter=4, drafter=tiny_mar(img_size=20))
    with pytest.raises(ValueError, match="drafter config num_sampling_steps=6 is above"):
        sample_mar(m, ok, num_iter=4, drafter=tiny_mar(num_sampling_steps=6))
    for bad in (1, True, 2.5):
        with pytest.raises(ValueError, match="num_sampling_steps"):
            tiny_mar().set_num_sampling_steps(bad)
    assert tiny_mar().set_num_sampling_steps(3).config.num_sampling_steps == 3
    with pytest.raises(ValueError, match="drafter config class_num"):
        sample_mar(m, ok, num_iter=4, drafter=tiny_mar(class_num=6))
    with pytest.raises(ValueError, match="temperature"):
        sample_mar(m, ok, num_iter=4, drafter=m, temperature=0.0)
    with pytest.raises(ValueError, match="cfg_schedule"):
        sample_mar(m, ok, num_iter=4, cfg_schedule="cosine")
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="num_draft_steps"):
            sample_mar(m, ok, num_iter=4, drafter=m, num_draft_steps=bad)
    with pytest.raises(ValueError, match="final_step_noise"):
        sample_mar(m, ok, num_iter=4, drafter=m, final_step_noise=False)
    with pytest.raises(TypeError, match="generator"):
        sample_mar(m, ok, num_iter=4, generator=7)
    with pytest.raises(ValueError, match="generator"):
        sample_mar(m, ok, num_iter=4, generator=[torch.Generator()] * 2)


def test_noise_is_drawn_on_the_generators_device_and_moved():
    """A CPU generator (diffusers' convention) may drive a model on another device: the noise is
    drawn on the generator's device, then moved, and a seed gives the numbers of a CPU draw.
    ("meta" only shows the placement; the CUDA case, where torch refuses a CPU generator for a
    draw on the GPU, is tests/test_core_cuda.py::test_cpu_generator_drives_mar_noise_on_cuda.)"""
    g = lambda: torch.Generator().manual_seed(3)
    cpu = draw_noise(2, 5, 3, 4, g(), "cpu", torch.float64)
    meta = draw_noise(2, 5, 3, 4, g(), "meta", torch.float64)
    for name in ("orders", "init", "steps", "final"):
        assert getattr(meta, name).device.type == "meta" and getattr(meta, name).shape == getattr(cpu, name).shape
    ref = torch.Generator().manual_seed(3)
    assert torch.equal(cpu.orders, torch.rand(2, 5, generator=ref).argsort(1))
    assert torch.equal(cpu.init, torch.randn(2, 5, 3, generator=ref, dtype=torch.float64))


# -- pipeline -------------------------------------------------------------------------------


def tiny_vae(latent=4, levels=3, dtype=torch.float64):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * levels,
                         up_block_types=("UpDecoderBlock2D",) * levels, block_out_channels=(8,) * levels,
                         layers_per_block=1, latent_channels=latent, norm_num_groups=4, sample_size=16,
                         scaling_factor=0.5).to(dtype).eval()


def test_pipeline_plain_and_speculative_and_round_trip(tmp_path):
    from mmspec.pipelines import SpeculativeMARPipeline

    m, d = tiny_mar(), tiny_mar(seed=3)
    pipe = SpeculativeMARPipeline(transformer=m, vae=tiny_vae(), drafter=d)
    pipe.set_progress_bar_config(disable=True)
    out = pipe([1, 2], num_iter=4, generator=torch.Generator().manual_seed(0), speculative=False, output_type="latent")
    tokens, _ = sample_mar(m, torch.tensor([1, 2]), num_iter=4, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(out.images, m.unpatchify(tokens))
    spec = pipe([1, 2], num_iter=4, generator=torch.Generator().manual_seed(0), output_type="np")
    assert spec.images.shape == (2, 16, 16, 3) and spec.stats.spec.draft_calls > 0
    imgs = pipe(3, num_iter=2, generator=torch.Generator().manual_seed(0)).images
    assert len(imgs) == 1 and imgs[0].size == (16, 16)
    pipe.save_pretrained(tmp_path / "p")
    again = SpeculativeMARPipeline.from_pretrained(tmp_path / "p", torch_dtype=torch.float64)
    again.set_progress_bar_config(disable=True)
    assert again.drafter is not None and again.transformer.config.class_num == 5
    o2 = again([1, 2], num_iter=4, generator=torch.Generator().manual_seed(0), output_type="np")
    assert abs(o2.images - spec.images).max() < 1e-6
    solo = SpeculativeMARPipeline(transformer=m, vae=tiny_vae())
    solo.save_pretrained(tmp_path / "solo")
    assert SpeculativeMARPipeline.from_pretrained(tmp_path / "solo").drafter is None


def test_broken_vae_decoder_is_refused_not_returned_as_an_image():
    """A VAE decoder that turns out NaN would give a broken picture (clamp keeps NaN): refused
    with a ValueError naming the decoder; latents are still available as output_type='latent'."""
    from mmspec.pipelines import SpeculativeMARPipeline

    vae = tiny_vae()
    with torch.no_grad():
        vae.decoder.conv_in.weight.fill_(float("nan"))
    pipe = SpeculativeMARPipeline(transformer=tiny_mar(), vae=vae)
    pipe.set_progress_bar_config(disable=True)
    for output_type in ("pil", "np", "pt"):
        with pytest.raises(ValueError, match="VAE decoder produced non-finite pixels"):
            pipe([1], num_iter=2, speculative=False, output_type=output_type)
    assert torch.isfinite(pipe([1], num_iter=2, speculative=False, output_type="latent").images).all()


def test_pipeline_refuses_bad_inputs():
    from mmspec.pipelines import SpeculativeMARPipeline

    m = tiny_mar()
    pipe = SpeculativeMARPipeline(transformer=m, vae=tiny_vae())
    pipe.set_progress_bar_config(disable=True)
    with pytest.raises(ValueError, match="drafter"):
        pipe([0], num_iter=2)
    with pytest.raises(ValueError, match="class_labels"):
        pipe([7], num_iter=2, speculative=False)
    with pytest.raises(ValueError, match=rf"class_labels must be in \[0, {m.config.class_num}\)"):  # the null class
        pipe([m.config.class_num], num_iter=2, speculative=False)
    with pytest.raises(TypeError, match="speculative must be True or False"):  # "no" read as True
        pipe([0], num_iter=2, speculative="no")
    with pytest.raises(TypeError, match="drafter must be None or a MARModel"):  # diffusers: AttributeError '__module__'
        pipe.drafter = "small"
    with pytest.raises(TypeError, match="return_dict must be True or False"):  # "no" returned the output object
        pipe([0], num_iter=2, return_dict="no")
    for bad in (0, -1, 17, 2.0, True):  # 16 tokens
        with pytest.raises(ValueError, match="num_iter"):
            pipe([0], num_iter=bad, speculative=False)
    with pytest.raises(ValueError, match="acceptance"):
        pipe([0], num_iter=2, speculative=False, acceptance="exact")
    with pytest.raises(ValueError, match="vae latent_channels"):
        SpeculativeMARPipeline(transformer=m, vae=tiny_vae(latent=3))([0], num_iter=2, speculative=False)
    with pytest.raises(ValueError, match="vae downsamples"):
        SpeculativeMARPipeline(transformer=m, vae=tiny_vae(levels=2))([0], num_iter=2, speculative=False)
    with pytest.raises(ValueError, match="output_type"):
        pipe([0], num_iter=2, speculative=False, output_type="jpg")


def test_pipeline_refuses_sampling_settings_before_its_progress_bar(capsys):
    """temperature, guidance, schedule and the draft options were checked inside the sampler, so a
    user saw a 0% bar before the error (and the bar was left open); now nothing is drawn first."""
    from mmspec.pipelines import SpeculativeMARPipeline

    m = tiny_mar()
    pipe = SpeculativeMARPipeline(transformer=m, vae=tiny_vae(), drafter=tiny_mar(seed=1))
    cases = [(dict(temperature=-1.0, speculative=False), "temperature must be a finite number >= 0"),
             (dict(temperature=True, speculative=False), "temperature must be a finite number >= 0"),
             (dict(temperature=1e31, speculative=False), "temperature=1e.31 is too large"),
             (dict(guidance_scale=float("nan"), speculative=False), "guidance_scale must be a finite number"),
             (dict(cfg_schedule="cosine", speculative=False), "cfg_schedule must be 'linear' or 'constant'"),
             (dict(temperature=0.0), "temperature must be > 0 for speculative sampling"),
             (dict(num_draft_steps=0), "num_draft_steps must be an int >= 1"),
             (dict(num_draft_steps="four", draft="self"), "num_draft_steps must be an int >= 1"),
             (dict(prefill_fraction=1.5), r"prefill_fraction must be a number in \[0, 1\]"),
             (dict(prefill_fraction="half"), r"prefill_fraction must be a number in \[0, 1\]")]
    # the draft options fail the same way with speculative=False (they passed silently there)
    cases += [(dict(num_draft_steps=-3, speculative=False), "num_draft_steps must be an int >= 1"),
              (dict(prefill_fraction=7.0, speculative=False), r"prefill_fraction must be a number in \[0, 1\]")]
    cases += [(dict(generator=[torch.Generator()]), "a list of 1 generators"), (dict(generator=3), "generator must be")]
    for kwargs, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            pipe([0], num_iter=2, **kwargs)
        assert "it/s" not in capsys.readouterr().err, kwargs  # no bar was drawn
    pipe([0], num_iter=2, output_type="latent")  # a valid call draws it
    assert "it/s" in capsys.readouterr().err


def test_bad_models_are_refused():
    from mmspec.pipelines import SpeculativeMARPipeline

    m, ok = tiny_mar(), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="drafter dtype"):
        sample_mar(m, ok, num_iter=4, drafter=tiny_mar(seed=2, dtype=torch.float32))
    with pytest.raises(TypeError, match="drafter must be a mmspec.models.mar.MARModel"):
        sample_mar(m, ok, num_iter=4, drafter=torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="target must be"):
        sample_mar(torch.nn.Linear(2, 2), ok, num_iter=4)
    with pytest.raises(TypeError, match="drafter must be"):
        SpeculativeMARPipeline(transformer=m, vae=tiny_vae(), drafter=torch.nn.Linear(2, 2))([0], num_iter=2)


def test_non_finite_models_are_refused_not_decoded():
    """A model whose head turns out NaN (broken weights, an overflowing dtype) is refused with
    a ValueError naming it, in plain and in speculative sampling, instead of returning NaN
    tokens that decode into a silently broken image."""
    ok = torch.tensor([0, 1])

    def broken(seed=0):
        m = tiny_mar(seed=seed)
        with torch.no_grad():
            next(p for n, p in m.named_parameters() if n.startswith("diffloss")).fill_(float("nan"))
        return m

    with pytest.raises(ValueError, match="MAR target produced non-finite tokens"):
        sample_mar(broken(), ok, num_iter=4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="MAR target produced non-finite tokens"):
        sample_mar(broken(), ok, num_iter=4, drafter=tiny_mar(seed=5), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="MAR drafter produced non-finite tokens"):
        sample_mar(tiny_mar(), ok, num_iter=4, drafter=broken(seed=5), prefill_fraction=0.0,
                   generator=torch.Generator().manual_seed(0))


def test_saved_folder_with_another_architecture_is_refused(tmp_path):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from mmspec.pipelines import SpeculativeMARPipeline

    SpeculativeMARPipeline(transformer=tiny_mar(dtype=torch.float32), vae=tiny_vae(dtype=torch.float32),
                           drafter=tiny_mar(seed=1, dtype=torch.float32)).save_pretrained(tmp_path / "p")
    assert SpeculativeMARPipeline.from_pretrained(tmp_path / "p").drafter is not None  # the intact folder loads
    # a VAE where the transformer should be (diffusers alone would load a randomly initialised MAR)
    shutil.copytree(tmp_path / "p", tmp_path / "swap")
    shutil.rmtree(tmp_path / "swap" / "transformer")
    shutil.copytree(tmp_path / "p" / "vae", tmp_path / "swap" / "transformer")
    with pytest.raises(ValueError, match="transformer: .* must hold a MARModel"):
        SpeculativeMARPipeline.from_pretrained(tmp_path / "swap")
    # right class name, weights of another MAR size: refused instead of half-initialised
    shutil.copytree(tmp_path / "p", tmp_path / "wide")
    cfg_path = tmp_path / "wide" / "drafter" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["encoder_depth"] = 2
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="drafter: the weights .*missing_keys.*encoder_blocks.1"):
        SpeculativeMARPipeline.from_pretrained(tmp_path / "wide")
    # an extra tensor in the weights file is refused too
    shutil.copytree(tmp_path / "p", tmp_path / "extra")
    (w,) = (tmp_path / "extra" / "transformer").glob("*.safetensors")
    sd = load_file(w)
    sd["not_a_mar_weight"] = torch.zeros(1)
    save_file(sd, w)
    with pytest.raises(ValueError, match="transformer: the weights .*unexpected_keys"):
        SpeculativeMARPipeline.from_pretrained(tmp_path / "extra")


def test_relaxed_rule_in_the_sampler():
    """tau = 1 reproduces exact CSpD draw for draw; CSpD's public-code tau = 42 keeps more drafts
    on a pair whose final-step Gaussians sit apart (the lossy trade `mmspec bench mar` measures)."""
    from mmspec.acceptance import ContinuousAcceptance, RelaxedContinuousAcceptance

    target, _ = _ks_setup()
    drafter = copy.deepcopy(target)
    W = target.diffloss.W
    drafter.diffloss = GaussianHead(target.diffloss, W + 0.05 * torch.randn(W.shape, generator=torch.Generator().manual_seed(4),
                                                                           dtype=torch.float64))
    labels = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    kw = dict(num_iter=6, guidance_scale=1.5, drafter=drafter, num_draft_steps=3, prefill_fraction=0.2)
    runs = {}
    for name, rule in (("exact", ContinuousAcceptance()), ("tau1", RelaxedContinuousAcceptance(1.0)),
                       ("tau42", RelaxedContinuousAcceptance(42.0))):
        runs[name] = sample_mar(target, labels, acceptance=rule, generator=torch.Generator().manual_seed(9), **kw)
    assert torch.equal(runs["exact"][0], runs["tau1"][0])
    assert runs["exact"][1].accepted_tokens == runs["tau1"][1].accepted_tokens
    exact, relaxed = runs["exact"][1], runs["tau42"][1]
    assert relaxed.acceptance_rate > exact.acceptance_rate + 0.2, (exact.summary(), relaxed.summary())
    assert bool(torch.isfinite(runs["tau42"][0]).all())


def test_bf16_drafts_are_judged_as_drawn_not_as_rounded():
    """The accept test is exact for a draft that follows q; it judged the draft after rounding to
    the model dtype, and in bfloat16 one rounding step near |x| ~ 1 is 1-4 standard deviations of
    the last denoising step, so bf16 CSpD drifted from plain sampling (p ~ 1e-80 on a per-value
    chi-square over 20000 images in the review's reproducer)."""
    from mmspec.acceptance import ContinuousAcceptance

    judged = []

    class Recording(ContinuousAcceptance):
        def accept_tokens(self, x, *args, **kwargs):
            judged.append(x.clone())
            return super().accept_tokens(x, *args, **kwargs)

    target = tiny_mar(0, dtype=torch.bfloat16)
    drafter = tiny_mar(0, dtype=torch.bfloat16)  # the same weights: drafts are accepted, so they get committed
    labels = torch.tensor([1, 3])
    tokens, st = sample_mar(target, labels, num_iter=4, drafter=drafter, num_draft_steps=3, acceptance=Recording(),
                            generator=torch.Generator().manual_seed(0))
    x = torch.cat([j.flatten() for j in judged])
    assert x.dtype == torch.float64 and x.numel() > 0
    off_grid = (x.to(torch.bfloat16).double() != x).double().mean().item()
    assert off_grid > 0.9, off_grid  # judged as drawn (float64), not on the bfloat16 grid
    assert st.accepted_tokens > 0 and tokens.dtype == torch.bfloat16  # what is committed is still the model's dtype


def test_a_draft_length_past_the_last_step_is_clamped_and_a_discrete_rule_refused():
    """num_draft_steps=10**12 died allocating a [B, K + 1] tensor; a round never drafts past the
    last step, so K is clamped to num_iter (same images for a seed as K = num_iter). A rule name or
    a discrete rule in sample_mar failed in the first verify with an AttributeError."""
    from mmspec.pipelines.cspd_self import sample_mar_self

    m, labels = tiny_mar(0), torch.tensor([0, 2])
    for sampler, extra in ((sample_mar, dict(drafter=tiny_mar(1))), (sample_mar_self, {})):
        runs = [sampler(m, labels, num_iter=3, num_draft_steps=k, generator=torch.Generator().manual_seed(2), **extra)
                for k in (3, 10 ** 12)]
        assert torch.equal(runs[0][0], runs[1][0]) and runs[1][1].draft_steps == 3
    from mmspec.acceptance import ExactAcceptance

    for bad in ("continuous", ExactAcceptance()):
        with pytest.raises(ValueError, match="acceptance must be a ContinuousAcceptance"):
            sample_mar(m, labels, num_iter=3, drafter=tiny_mar(1), acceptance=bad)


def test_numpy_scalars_are_taken_as_the_numbers_they_hold():
    """np.float32(3.0) as guidance was refused as "must be a finite number"; np.int64 steps and
    labels too."""
    import numpy as np

    from mmspec.pipelines import SpeculativeMARPipeline

    pipe = SpeculativeMARPipeline(transformer=tiny_mar(), vae=tiny_vae(), drafter=tiny_mar(seed=1))
    pipe.set_progress_bar_config(disable=True)
    kw = dict(output_type="latent", num_iter=4, guidance_scale=2.0, num_draft_steps=2)
    ref = pipe([1], generator=torch.Generator().manual_seed(0), **kw).images
    out = pipe(np.int64(1), generator=torch.Generator().manual_seed(0), output_type="latent", num_iter=np.int64(4),
               guidance_scale=np.float32(2.0), num_draft_steps=np.int64(2)).images
    assert torch.equal(out, ref)


def test_save_and_load_options_it_cannot_read_back_are_refused(tmp_path):
    from mmspec.pipelines import SpeculativeMARPipeline

    pipe = SpeculativeMARPipeline(transformer=tiny_mar(), vae=tiny_vae(), drafter=tiny_mar(seed=1))
    with pytest.raises(ValueError, match=r"\['variant'\] not supported"):
        pipe.save_pretrained(tmp_path / "v", variant="fp16")  # wrote a folder neither load call could read
    assert not (tmp_path / "v").exists()
    pipe.save_pretrained(tmp_path / "p")
    with pytest.raises(TypeError, match="torch_dtype must be a torch.dtype"):
        SpeculativeMARPipeline.from_pretrained(tmp_path / "p", torch_dtype="float16")  # loaded float32
    assert SpeculativeMARPipeline.from_pretrained(tmp_path / "p", torch_dtype=torch.bfloat16).transformer.dtype == torch.bfloat16
