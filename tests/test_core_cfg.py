"""Classifier-free guidance through `GuidedTarget`: greedy output equals a reference CFG
decoding loop (cache-free, two plain forwards per token), batched with left padding, for
chains and trees and with a schedule; exact sampling under guidance is distributed like the
guided target (chi-square against the enumerated guided joint, with a power check)."""

from __future__ import annotations

import pytest
import torch

import mmspec
from mmspec.drafters import ModelDrafter

from conftest import left_padded, noisy_copy, tiny_llama
from test_core_sampling import chi_square_p

UNCOND = 1  # the unconditional prompt of every row: a lone BOS


def uncond_prompts(B):
    return torch.full((B, 1), UNCOND, dtype=torch.long)


@torch.no_grad()
def reference_cfg_greedy(model, ids, mask, n, scale_at, uncond=(UNCOND,)):
    rows = []
    for b in range(ids.shape[0]):
        c = ids[b][mask[b].bool()].unsqueeze(0)
        u = torch.tensor([list(uncond)])
        for i in range(n):
            lc, lu = model(input_ids=c).logits[0, -1], model(input_ids=u).logits[0, -1]
            s = scale_at(i)
            nxt = (lu + s * (lc - lu)).argmax().view(1, 1)
            c, u = torch.cat([c, nxt], 1), torch.cat([u, nxt], 1)
        rows.append(c[0, -n:])
    return torch.stack(rows)


N = 16


@pytest.mark.parametrize("tree", [None, mmspec.TreeConfig(depth=3, top_k=2, num_nodes=6)], ids=["chain", "tree"])
@pytest.mark.parametrize("schedule", ["constant", "linear"])
def test_guided_greedy_equals_reference_cfg(target, good_drafter, tree, schedule):
    ids, mask = left_padded([9, 5, 7, 3])
    if schedule == "constant":
        scale, scale_at = 3.0, (lambda i: 3.0)
    else:  # grows linearly from 1 to 4 over the N tokens (LlamaGen's linear schedule shape)
        scale = lambda index: 1.0 + 3.0 * index.to(torch.float64) / N  # noqa: E731
        scale_at = lambda i: 1.0 + 3.0 * i / N  # noqa: E731
    ref = reference_cfg_greedy(target, ids, mask, N, scale_at)
    plain = reference_cfg_greedy(target, ids, mask, N, lambda i: 1.0)
    assert not torch.equal(ref, plain)  # guidance changes the output, so the test can fail
    guided = mmspec.GuidedTarget(target, scale, uncond_input_ids=uncond_prompts(4))
    out = mmspec.speculative_generate(
        guided, ModelDrafter(good_drafter, tree=tree) if tree else ModelDrafter(good_drafter, 3), ids, mask,
        temperature=0, max_new_tokens=N,
    )
    assert torch.equal(out.sequences[:, ids.shape[1]:], ref)
    assert out.stats.accepted_drafts > 0


def test_guided_rows_leave_together(target, weak_drafter):
    """EOS ends rows at different steps: both halves of a finished row must leave the batch."""
    ids, mask = left_padded([6, 4, 5])
    ref = reference_cfg_greedy(target, ids, mask, N, lambda i: 2.0)
    eos = int(ref[1, 3])  # row 1 ends by its 4th token
    guided = mmspec.GuidedTarget(target, 2.0, uncond_input_ids=uncond_prompts(3))
    out = mmspec.speculative_generate(
        guided, ModelDrafter(weak_drafter, 3), ids, mask, temperature=0, max_new_tokens=N, eos_token_id=eos,
        pad_token_id=0,
    )
    for b in range(3):
        row = ref[b].tolist()
        cut = row.index(eos) + 1 if eos in row else N
        assert out.sequences[b, ids.shape[1]: ids.shape[1] + cut].tolist() == row[:cut]
        assert out.stats.new_tokens[b] == cut
    assert out.stats.new_tokens[1] <= 4 and len(set(out.stats.new_tokens)) > 1  # rows left at different steps


def test_feature_drafters_under_longer_unconditional_prompts(target):
    """Unconditional prompts longer than the conditional rows pad those rows further at prefill:
    an EAGLE head got features [B, L_uncond, H] beside its [B, L_cond] input ids (a raw size
    error). The features it gets line up with its ids (equal to the target's own, unguided,
    at the real tokens), and greedy output equals the reference CFG loop."""
    from mmspec.drafters import EagleHead, EagleHeadConfig, EagleHeadDrafter

    ids, mask = left_padded([5, 3, 4])
    uncond = (UNCOND, 7, 8, 9, 10, 11, 12, 13)  # 8 tokens > the longest conditional prompt (5)
    ref = reference_cfg_greedy(target, ids, mask, N, lambda i: 3.0, uncond)
    torch.manual_seed(0)
    drafter = EagleHeadDrafter(target, EagleHead(EagleHeadConfig.for_target(target)).double(), 3)
    seen = {}
    prefill = drafter.prefill

    def spy(input_ids, attention_mask, target_out, *args, **kwargs):
        seen["ids"], seen["hidden"] = input_ids, target_out.hidden_states
        return prefill(input_ids, attention_mask, target_out, *args, **kwargs)

    drafter.prefill = spy
    guided = mmspec.GuidedTarget(target, 3.0, uncond_input_ids=torch.tensor([list(uncond)] * 3))
    out = mmspec.speculative_generate(guided, drafter, ids, mask, temperature=0, max_new_tokens=N)
    assert torch.equal(out.sequences[:, ids.shape[1]:], ref)
    assert seen["hidden"].shape[:2] == ids.shape
    with torch.no_grad():
        own = target(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
    real = mask.bool()
    assert torch.allclose(seen["hidden"][real], own[real], atol=1e-9)


def test_guided_target_refuses_bad_arguments(target):
    with pytest.raises(ValueError, match="exactly one"):
        mmspec.GuidedTarget(target, 2.0)
    with pytest.raises(ValueError, match="guidance_scale"):
        mmspec.GuidedTarget(target, float("nan"), uncond_input_ids=uncond_prompts(1))



def test_guided_target_refuses_an_unconditional_mask_it_cannot_use(target, good_drafter):
    """A mask of the wrong shape failed deep in the forward ("Sizes of tensors must match");
    a row of zeros ran with nothing to attend to."""
    from conftest import left_padded

    ids, mask = left_padded([4, 3])
    u = torch.full((2, 3), UNCOND, dtype=torch.long)
    run = lambda m: mmspec.speculative_generate(  # noqa: E731
        mmspec.GuidedTarget(target, 2.0, uncond_input_ids=u, uncond_attention_mask=m), ModelDrafter(good_drafter, 2),
        ids, mask, temperature=0, max_new_tokens=3)
    for bad, message in ((torch.ones(2, u.shape[1] + 1, dtype=torch.long), "must have the shape"),
                         (torch.ones(1, u.shape[1], dtype=torch.long), "must have the shape"),
                         (torch.zeros_like(u), "at least one token"), (torch.full_like(u, 2), "hold 0 / 1"),
                         (torch.cat([torch.ones_like(u[:, :1]), torch.zeros_like(u[:, 1:])], 1), "left-padded")):
        with pytest.raises(ValueError, match=message):
            run(bad)
    assert torch.equal(run(torch.ones_like(u).bool()).sequences, run(None).sequences)


V = 8
SAMPLES = 12000


@torch.no_grad()
def guided_joint_23(model, prompt, scale, sampling):
    """Exact guided P(token2, token3) [V, V] after `prompt` (uncond: BOS)."""

    def probs(ctx_c, ctx_u):
        lc, lu = model(input_ids=ctx_c).logits[:, -1], model(input_ids=ctx_u).logits[:, -1]
        return mmspec.process_logits(lu + scale * (lc - lu), sampling)

    u = torch.tensor([[UNCOND]])
    p1 = probs(prompt, u)[0]
    t1 = torch.arange(V).unsqueeze(1)
    c1, u1 = torch.cat([prompt.expand(V, -1), t1], 1), torch.cat([u.expand(V, -1), t1], 1)
    p2 = probs(c1, u1)
    t2 = torch.arange(V).repeat(V).unsqueeze(1)
    c2 = torch.cat([c1.repeat_interleave(V, 0), t2], 1)
    u2 = torch.cat([u1.repeat_interleave(V, 0), t2], 1)
    p3 = probs(c2, u2).view(V, V, V)
    return (p1[:, None, None] * p2[:, :, None] * p3).sum(0)


@pytest.mark.parametrize("tree", [None, mmspec.TreeConfig(depth=2, top_k=2, num_nodes=4)], ids=["chain", "tree"])
def test_guided_exact_sampling_matches_enumerated_joint(tree):
    model = tiny_llama(layers=2, seed=3, vocab=V, hidden=16)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    drafter = noisy_copy(model, 0.6, seed=9)
    prompt = torch.tensor([[1, 5, 3, 6]])
    scale, sampling = 2.5, mmspec.SamplingConfig(0.9, None)
    expected = guided_joint_23(model, prompt, scale, sampling)
    unguided = guided_joint_23(model, prompt, 1.0, sampling)
    out = mmspec.speculative_generate(
        mmspec.GuidedTarget(model, scale, uncond_input_ids=uncond_prompts(SAMPLES)),
        ModelDrafter(drafter, tree=tree) if tree else ModelDrafter(drafter, 3), prompt.expand(SAMPLES, -1),
        acceptance="exact", temperature=0.9, max_new_tokens=3, generator=torch.Generator().manual_seed(7),
    )
    new = out.sequences[:, 4:]
    counts = torch.zeros(V, V)
    counts.index_put_((new[:, 1], new[:, 2]), torch.ones(SAMPLES), accumulate=True)
    assert chi_square_p(counts, expected, SAMPLES) > 1e-4
    # Power: the same samples clearly reject the unguided distribution.
    assert chi_square_p(counts, unguided, SAMPLES) < 1e-4
    assert 0.2 < out.stats.verified_accepted / out.stats.row_steps < 2.5  # rejections exercised
