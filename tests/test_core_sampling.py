"""Exact speculative sampling is distributed like the target.

The target's joint distribution of new tokens 2 and 3 is enumerated exactly over a tiny
vocabulary; both tokens come out of one speculative step (the first new token is drawn at
prefill), so the test exercises acceptance at draft position 0 and 1, the residual and the
bonus. Chi-square with a fixed seed; cells with tiny expected counts are pooled so the
chi-square approximation holds (expected >= 5 per cell)."""

from __future__ import annotations

import pytest
import torch
from scipy import stats as sps

import mmspec
from mmspec.drafters import ModelDrafter

from conftest import noisy_copy, tiny_llama

V = 8
SAMPLES = 12000


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(layers=2, seed=3, vocab=V, hidden=16)
    with torch.no_grad():  # sharpen the target a little so distributions are not flat
        target.lm_head.weight.mul_(4.0)
    return target, noisy_copy(target, 0.6, seed=9)


@torch.no_grad()
def joint_23(model, prompt, sampling):
    """Exact P(token2, token3) [V, V] after `prompt` under `sampling`."""
    def probs(ctx):
        return mmspec.process_logits(model(input_ids=ctx).logits[:, -1], sampling)

    p1 = probs(prompt)[0]  # [V]
    ctx1 = torch.cat([prompt.expand(V, -1), torch.arange(V).unsqueeze(1)], 1)
    p2 = probs(ctx1)  # [V(t1), V(t2)]
    ctx2 = torch.cat([ctx1.repeat_interleave(V, 0), torch.arange(V).repeat(V).unsqueeze(1)], 1)
    p3 = probs(ctx2).view(V, V, V)  # [t1, t2, t3]
    return (p1[:, None, None] * p2[:, :, None] * p3).sum(0)


def chi_square_p(counts, expected_probs, n):
    exp = expected_probs.flatten() * n
    obs = counts.flatten().double()
    order = torch.argsort(exp)
    exp, obs = exp[order], obs[order]
    # Pool the smallest cells together until the pooled cell expects >= 5, taking in every cell
    # that expects < 5 on its own (kept apart, they made the test fail up to 6x more often than
    # its threshold says on joints with many small cells).
    cut = max(int((exp < 5).sum()), int((exp.cumsum(0) < 5).sum()) + 1)
    exp = torch.cat([exp[:cut].sum(0, keepdim=True), exp[cut:]])
    obs = torch.cat([obs[:cut].sum(0, keepdim=True), obs[cut:]])
    return sps.chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue


@pytest.mark.parametrize(
    "temperature,top_k,tree",
    [(1.0, None, None), (0.7, None, None), (1.0, 5, None), (0.7, 4, mmspec.TreeConfig(depth=2, top_k=2, num_nodes=5))],
    ids=["T1", "T0.7", "T1-topk5", "T0.7-topk4-tree"],
)
def test_exact_sampling_matches_enumerated_joint(pair, temperature, top_k, tree):
    target, drafter = pair
    prompt = torch.tensor([[1, 5, 3, 6]])
    sampling = mmspec.SamplingConfig(temperature, top_k)
    expected = joint_23(target, prompt, sampling)
    g = torch.Generator().manual_seed(2024)
    out = mmspec.speculative_generate(
        target, (ModelDrafter(drafter, tree=tree) if tree else ModelDrafter(drafter, 3)), prompt.expand(SAMPLES, -1),
        acceptance="exact", temperature=temperature, top_k=top_k, max_new_tokens=3, generator=g,
    )
    new = out.sequences[:, 4:]
    counts = torch.zeros(V, V)
    counts.index_put_((new[:, 1], new[:, 2]), torch.ones(SAMPLES), accumulate=True)
    # The drafter disagrees often enough that rejections and residuals are exercised (the
    # rule's raw accepted count per row-step, 3 drafts proposed).
    raw = out.stats.verified_accepted / out.stats.row_steps
    assert 0.2 < raw < 2.5
    assert chi_square_p(counts, expected, SAMPLES) > 1e-4


def test_chi_square_detects_a_wrong_distribution(pair):
    """The test above has power: the drafter's own samples are rejected by it."""
    target, drafter = pair
    prompt = torch.tensor([[1, 5, 3, 6]])
    sampling = mmspec.SamplingConfig(1.0)
    expected = joint_23(target, prompt, sampling)
    wrong = joint_23(drafter, prompt, sampling)
    g = torch.Generator().manual_seed(7)
    draws = torch.multinomial(wrong.flatten(), SAMPLES, replacement=True, generator=g)
    counts = torch.bincount(draws, minlength=V * V).view(V, V)
    assert chi_square_p(counts, expected, SAMPLES) < 1e-4


def test_draws_follow_the_generator_device_and_land_on_the_tensors_device():
    """`mmspec.sampling.draw`: numbers come from the generator's own device (so a CPU generator,
    diffusers' convention, can drive a CUDA model and a seed means the same numbers on either),
    then move to the requested device; with no generator they are drawn where they are needed.
    (tests/test_core_cuda.py checks the CPU-generator / CUDA-tensor case on a GPU.)"""
    from mmspec.sampling import draw

    a = draw(torch.rand, 3, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64, device="cpu")
    b = torch.rand(3, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    assert torch.equal(a, b) and a.dtype == torch.float64
    n = draw(torch.randn, torch.Size([2, 3]), generator=torch.Generator().manual_seed(1), device="meta")
    assert n.device.type == "meta" and n.shape == (2, 3)  # drawn on the generator's CPU, then moved
    assert draw(torch.rand, 5, device="meta").device.type == "meta"  # no generator: drawn there
    i = draw(torch.randint, 0, 7, (100,), generator=torch.Generator().manual_seed(2), device="cpu")
    assert i.dtype == torch.long and int(i.min()) >= 0 and int(i.max()) < 7
