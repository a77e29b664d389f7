"""Self-drafted CSpD (pipelines/cspd_self.py): path densities, drafts that must all pass when
the conditioning never changes, the sampled distribution against plain sampling (KS, with
a planted bug that must fail), batching, bad inputs, the pipeline's draft="self"."""

from __future__ import annotations

import copy

import pytest
import torch

from mmspec.pipelines.cspd import sample_mar
import mmspec.pipelines.cspd_self as cspd_self
from mmspec.pipelines.cspd_self import sample_mar_self

from test_mar_cspd import GaussianHead, tiny_mar, tiny_vae


def _paths(head, N=6, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    D, S = head.in_channels, head.gen.num_steps
    z, zu = torch.randn(N, 32, generator=g, dtype=dtype), torch.randn(N, 32, generator=g, dtype=dtype)
    cfg = torch.full((N,), 2.0, dtype=dtype)
    noise = (torch.randn(N, D, generator=g, dtype=dtype), torch.randn(N, S - 1, D, generator=g, dtype=dtype),
             torch.randn(N, D, generator=g, dtype=dtype))
    return z, zu, cfg, noise


def test_path_density_of_a_sampled_path_matches_its_batched_evaluation():
    head = tiny_mar().diffloss
    z, zu, cfg, noise = _paths(head)
    out = head.trajectory(z, *noise, z_uncond=zu, cfg=cfg, temperature=0.8, record=True)
    assert out.states.shape == (6, head.gen.num_steps, head.in_channels)
    plain = head.trajectory(z, *noise, z_uncond=zu, cfg=cfg, temperature=0.8)
    assert torch.equal(out.sample, plain.sample)  # recording changes nothing
    along = head.log_density_along(out.states, out.sample, z, zu, cfg, 0.8)
    assert torch.allclose(along, out.log_density, atol=1e-9, rtol=0)
    other = head.log_density_along(out.states, out.sample, z + 0.3, zu, cfg, 0.8)  # another conditioning
    assert (other - out.log_density).abs().min() > 1e-3
    # the density under another conditioning, taken in the same head calls (extra rows)
    rows = torch.tensor([1, 4])
    both = head.trajectory(z, *noise, z_uncond=zu, cfg=cfg, temperature=0.8, alt=(rows, z[rows] + 0.3, zu[rows]))
    assert torch.allclose(both.sample, out.sample, atol=1e-12, rtol=0)
    assert torch.allclose(both.alt_log_density, other[rows], atol=1e-9, rtol=1e-12)
    with pytest.raises(ValueError, match="final_noise"):
        head.trajectory(z, noise[0], noise[1], None, z_uncond=zu, cfg=cfg, record=True)


def _frozen(m):
    """The same model whose conditioning ignores the known tokens: stale z equals fresh z."""
    m = copy.deepcopy(m)
    base = m.forward_z
    m.forward_z = lambda tok, known, emb, need=None: base(torch.zeros_like(tok), torch.zeros_like(known), emb, need=need)
    return m


@pytest.mark.parametrize("guidance", [1.0, 2.0])
def test_unchanging_conditioning_accepts_every_draft_and_equals_plain_sampling(guidance):
    m = _frozen(tiny_mar())
    labels = torch.tensor([0, 3, 4, 1])
    plain, st0 = sample_mar(m, labels, num_iter=7, guidance_scale=guidance, generator=torch.Generator().manual_seed(1))
    spec, st = sample_mar_self(m, labels, num_iter=7, guidance_scale=guidance, num_draft_steps=2,
                               generator=torch.Generator().manual_seed(1))
    assert st.drafted_tokens > 0 and st.accepted_tokens == st.judged_tokens == st.drafted_tokens, st.summary()
    assert st.residual_tokens == st.fallbacks == st.residual_tries == 0
    assert torch.allclose(spec, plain, atol=1e-10, rtol=0)
    assert st.spec.target_calls < st0.spec.target_calls == 7  # a forward every 3 steps, the first included


def _ks_model():
    """A tiny MAR whose head is Bayes-optimal for data N(W z, s^2) and whose conditioning drifts
    in one direction as tokens are revealed (z = z_class + 3 * known fraction * v): a stale
    draft is shifted against the target by the same amount in every row, so a bug that keeps
    stale drafts shows in the marginal of every drafted position (a random drift per row would
    cancel there)."""
    m = tiny_mar(1, img_size=12, vae_stride=4, vae_embed_dim=2, num_sampling_steps=4, class_num=3)
    W = torch.randn(32, 2, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 0.3
    m.diffloss = GaussianHead(m.diffloss, W)
    v = torch.randn(32, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    base, v = m.forward_z, v / v.norm()
    m.forward_z = lambda tok, known, emb, need=None: (base(torch.zeros_like(tok), torch.zeros_like(known), emb, need=need)
                                           + 3.0 * known.double().mean(1)[:, None, None] * v)
    return m


def _ks(n=2000, K=2):
    from scipy.stats import ks_2samp

    m = _ks_model()
    L = m.seq_len
    labels = torch.full((n,), 2, dtype=torch.long)
    plain, _ = sample_mar(m, labels, num_iter=L, guidance_scale=1.5, temperature=1.0,
                          generator=torch.Generator().manual_seed(10))
    spec, st = sample_mar_self(m, labels, num_iter=L, guidance_scale=1.5, temperature=1.0, num_draft_steps=K,
                               residual_tries=4, generator=torch.Generator().manual_seed(11))
    pvals = [ks_2samp(plain[:, l, j].numpy(), spec[:, l, j].numpy()).pvalue for l in range(L) for j in range(2)]
    return min(pvals), len(pvals), st


def test_token_distribution_matches_plain_sampling_ks():
    p_min, k, st = _ks()
    # the test must exercise acceptance, rejection and the residual, across rows of their own pace
    assert 0.2 < st.acceptance_rate < 0.95, st.summary()
    assert st.residual_tokens > 500 and st.fallbacks < 0.01 * st.residual_tokens, st.summary()
    assert p_min > 0.01 / k, (p_min, st.summary())  # Bonferroni over the k position x dimension tests


def test_ks_has_power_against_accepting_every_draft(monkeypatch):
    # planted bug: no verification (drafts from stale conditioning are emitted as they are)
    monkeypatch.setattr(cspd_self, "accept_draft", lambda u, log_p, log_q: torch.ones_like(u, dtype=torch.bool))
    p_min, k, st = _ks()
    assert st.acceptance_rate == 1.0 and st.residual_tokens == 0
    assert p_min < 0.01 / k, (p_min, st.summary())


def test_bad_inputs_are_refused_naming_the_argument():
    m = tiny_mar()
    labels = torch.tensor([0, 1])
    for kw, name in ((dict(num_iter=4, temperature=0.0), "temperature"), (dict(num_iter=4, num_draft_steps=0), "num_draft_steps"),
                     (dict(num_iter=4, residual_tries=True), "residual_tries"),
                     (dict(num_iter=4, max_residual_tries=0), "max_residual_tries"),
                     (dict(num_iter=0), "num_iter"), (dict(num_iter=4, cfg_schedule="cosine"), "cfg_schedule")):
        with pytest.raises(ValueError, match=name):
            sample_mar_self(m, labels, **kw)
    with pytest.raises(ValueError, match="class_labels"):
        sample_mar_self(m, torch.tensor([0, 99]), num_iter=4)
    with pytest.raises(TypeError, match="MARModel"):
        sample_mar_self(torch.nn.Linear(2, 2), labels, num_iter=4)


def test_non_finite_paths_are_refused():
    m = tiny_mar()
    with torch.no_grad():
        m.diffloss.net.final_layer.linear.bias.fill_(float("nan"))
    with pytest.raises(ValueError, match="non-finite"):
        sample_mar_self(m, torch.tensor([0]), num_iter=4)


def test_pipeline_draft_self(tmp_path):
    from mmspec.pipelines import SpeculativeMARPipeline

    m = tiny_mar()
    pipe = SpeculativeMARPipeline(transformer=m, vae=tiny_vae())  # no drafter model: draft="self" needs none
    kw = dict(num_iter=8, guidance_scale=2.0, output_type="latent")
    a = pipe([0, 2, 4], draft="self", num_draft_steps=2, generator=torch.Generator().manual_seed(3), **kw)
    b = pipe([0, 2, 4], draft="self", num_draft_steps=2, generator=torch.Generator().manual_seed(3), **kw)
    assert torch.equal(a.images, b.images) and a.stats.drafted_tokens > 0  # a seed gives the same images
    from mmspec.acceptance import ContinuousAcceptance

    c = pipe([0, 2, 4, 1], draft="self", acceptance=ContinuousAcceptance(max_tries=6, tries_per_block=3),
             generator=torch.Generator().manual_seed(3), **kw).stats
    assert c.residual_tokens > 0 and c.residual_tries % 3 == 0  # the rule's proposals per round are honoured
    assert c.residual_tries <= 6 * c.residual_tokens + 3 * 4  # at most max_tries per token (+ pending rounds)
    with pytest.raises(ValueError, match="draft"):
        pipe([0], draft="other", **kw)
    with pytest.raises(ValueError, match="drafter"):
        pipe([0], draft="model", **kw)
    with pytest.raises(ValueError, match="acceptance"):
        pipe([0], draft="self", acceptance="continuous-relaxed", **kw)


def test_pipeline_auto_draft_steps_choose_per_request_by_measured_speed():
    from mmspec.pipelines import SpeculativeMARPipeline

    pipe = SpeculativeMARPipeline(transformer=tiny_mar(), vae=tiny_vae())
    kw = dict(num_iter=6, guidance_scale=2.0, output_type="latent")
    outs = [pipe([0, 3], generator=torch.Generator().manual_seed(i), draft="self", num_draft_steps="auto", **kw)
            for i in range(9)]
    ks = [o.stats.draft_steps for o in outs]
    (setting, bandit), = pipe._self_draft_bandits.items()
    assert setting == (6, 2.0, "linear", 1.0)  # num_iter, guidance, schedule, temperature
    assert ks == [arm for _, arm in bandit.requests]  # the stats report what ran
    assert ks[:6] == [4, 4, 3, 2, 1, 0]  # the batch size's cold first request is not counted; then every arm once
    assert set(bandit.batches[2].raw) == {0, 1, 2, 3, 4}  # each one's measured rate, at batch 2
    # K = 0 is plain sampling through the same code: plain sampling's image for the seed
    plain = pipe([0, 3], generator=torch.Generator().manual_seed(5), speculative=False, **kw)
    assert torch.equal(outs[5].images, plain.images)
    assert outs[4].stats.draft_steps == 1 and outs[4].stats.drafted_tokens > 0
    with pytest.raises(ValueError, match="num_draft_steps='auto' is for draft='self'"):
        pipe([0], num_draft_steps="auto", **kw)
    # Another step count is another request cost: its own bandit, starting cold; the first keeps its rates.
    fewer = pipe([0, 3], generator=torch.Generator().manual_seed(0), draft="self", num_draft_steps="auto",
                 **{**kw, "num_iter": 3})
    assert set(pipe._self_draft_bandits) == {(6, 2.0, "linear", 1.0), (3, 2.0, "linear", 1.0)}
    assert pipe._self_draft_bandits[(3, 2.0, "linear", 1.0)].requests == [(2, fewer.stats.draft_steps)]
    assert len(bandit.requests) == 9 and set(bandit.batches[2].raw) == {0, 1, 2, 3, 4}
