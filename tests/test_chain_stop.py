"""Chains end once every row has drafted EOS (drafters/chain_stop.py), and nothing else changes:
greedy output equals plain greedy decoding (float64, batched, prompts of different lengths, a
text drafter and the EAGLE / ViSpec heads on LLaVA), exact sampling stays distributed like the
target (chi-square against the enumerated joint, with EOS cells), the adaptive controller learns
the chain length that ran, and the cut really happens (the step drafts fewer tokens)."""

from __future__ import annotations

import pytest
import torch

import mmspec
from mmspec.drafters import ModelDrafter
from mmspec.drafters.chain_stop import ChainStop

from _vlm_helpers import assert_rows_equal
from conftest import left_padded, noisy_copy, tiny_llama
from test_core_greedy import LENGTHS, reference
from test_core_sampling import chi_square_p, joint_23
from test_drafters_eagle import make
from test_vlm_llava import llava, llava_batch, row_by_row  # noqa: F401 (fixture)


def test_chain_stop_flags():
    stop = ChainStop()
    assert stop.begin(3, "cpu") is None  # no stop tokens: never ends early
    stop.set([7, 2, 7])
    flags = stop.begin(3, "cpu")
    assert not stop.every_row_ended(flags, torch.tensor([7, 1, 1]))
    assert not stop.every_row_ended(flags, torch.tensor([0, 2, 1]))  # row 0 stays ended
    assert stop.every_row_ended(flags, torch.tensor([0, 0, 7]))
    stop.set([])
    assert stop.begin(3, "cpu") is None
    stop.set([1])
    assert stop.begin(3, "meta") is None  # off the CPU the chain runs in full (no host sync)


def test_perfect_drafter_chain_ends_at_the_drafted_eos(target):
    ids, mask = left_padded([6])
    free = reference(target, ids, mask, 12)[:, ids.shape[1]:]
    eos = int(free[0, 3])  # the drafter (= the target) drafts it as its 3rd token in step 1
    assert eos not in free[0, :3].tolist()
    out = mmspec.speculative_generate(target, ModelDrafter(target, 5), ids, mask, temperature=0, max_new_tokens=12,
                                      eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out.sequences, reference(target, ids, mask, 12, eos=eos))
    assert out.stats.nodes_per_step == [3]  # tokens 2-4 drafted, the last one EOS: no 4th and 5th
    assert out.stats.draft_calls == 1 + 1 + 2  # prompt, root, drafts 1 and 2 (not 3 and 4)
    assert out.stats.new_tokens == [4]


@pytest.mark.parametrize("K", [3, 5])
def test_batched_greedy_with_eos_equals_plain(target, good_drafter, K):
    ids, mask = left_padded(LENGTHS)
    free = reference(target, ids, mask, 24)[:, ids.shape[1]:]
    cut_somewhere = False
    for eos in {int(free[0, 3]), int(free[2, 6]), int(free[3, 1])}:
        ref = reference(target, ids, mask, 24, eos=eos)
        for drafter in (ModelDrafter(good_drafter, K), ModelDrafter(target, K)):
            out = mmspec.speculative_generate(target, drafter, ids, mask, temperature=0, max_new_tokens=24,
                                              eos_token_id=eos, pad_token_id=0)
            assert torch.equal(out.sequences, ref)
            if max(out.stats.new_tokens) < 24 - K:  # every row ended at EOS, none near its budget
                cut_somewhere |= any(n < K for n in out.stats.nodes_per_step)
    assert cut_somewhere  # a step drafted fewer than K: its rows had all drafted EOS


@pytest.mark.parametrize("kind", ["eagle", "vispec"])
def test_feature_heads_end_the_chain_at_eos(llava, kind):
    model, _ = llava
    ids, mask, pixels = llava_batch([(4, 1)], seed=7)
    drafter = make(model, kind, None, K=4)
    drafted = []
    drafter.propose = _recording(drafter.propose, drafted)
    mmspec.speculative_generate(model, drafter, ids, mask, temperature=0, max_new_tokens=10, pixel_values=pixels)
    first = drafted[0][0].tolist()
    eos = first[1]  # the head's second draft of step 1 becomes EOS
    if eos == first[0]:
        pytest.fail(f"head drafted the same token twice ({first}); pick another seed")
    refs = row_by_row(model, ids, mask, 10, eos, pixel_values=pixels)
    drafted.clear()
    out = mmspec.speculative_generate(model, drafter, ids, mask, temperature=0, max_new_tokens=10,
                                      pixel_values=pixels, eos_token_id=eos, pad_token_id=0)
    assert_rows_equal(out.sequences, ids.shape[1], refs)
    assert drafted[0][0].tolist() == first[:2] and out.stats.nodes_per_step[0] == 2


def _recording(propose, into):
    def wrapped(*a):
        draft = propose(*a)
        into.append(draft.tokens)
        return draft
    return wrapped


def test_auto_controller_learns_the_chain_length_that_ran(target):
    ids, mask = left_padded([6])
    free = reference(target, ids, mask, 12)[:, ids.shape[1]:]
    eos = int(free[0, 2])
    drafter = ModelDrafter(target, "auto", max_draft_tokens=4)
    seen, chosen = [], []
    observe, set_k = drafter.controller.observe, drafter.set_draft_length
    drafter.controller.observe = lambda batch, k, *a, **kw: seen.append(k) or observe(batch, k, *a, **kw)
    drafter.set_draft_length = lambda k: chosen.append(k) or set_k(k)
    out = mmspec.speculative_generate(target, drafter, ids, mask, temperature=0, max_new_tokens=12,
                                      eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out.sequences, reference(target, ids, mask, 12, eos=eos))
    assert seen == out.stats.nodes_per_step  # what was drafted, not the K chosen
    assert any(s < c for s, c in zip(seen, chosen)), (seen, chosen)  # and the chain was cut


# ---- exact sampling at batch 1 (a chain ends only when every row drafted EOS) -------------
V, N = 8, 2500


@torch.no_grad()
def joint_with_eos(model, prompt, sampling, eos):
    """P over outcomes of new tokens 2 and 3 with EOS: [V + 1, V + 1], index V = after EOS."""
    def probs(ctx):
        return mmspec.process_logits(model(input_ids=ctx).logits[:, -1], sampling)

    p1 = probs(prompt)[0]
    ctx1 = torch.cat([prompt.expand(V, -1), torch.arange(V).unsqueeze(1)], 1)
    p2 = probs(ctx1)
    ctx2 = torch.cat([ctx1.repeat_interleave(V, 0), torch.arange(V).repeat(V).unsqueeze(1)], 1)
    p3 = probs(ctx2).view(V, V, V)
    alive = torch.ones(V, dtype=p1.dtype)
    alive[eos] = 0
    out = torch.zeros(V + 1, V + 1, dtype=p1.dtype)
    out[V, V] = p1[eos]
    full = ((p1 * alive)[:, None, None] * p2[:, :, None] * p3).sum(0)  # [t2, t3], t1 != eos
    out[:V, :V] = full
    out[eos, :V] = 0
    out[eos, V] = ((p1 * alive) * p2[:, eos]).sum()
    return out


def outcome_counts(seqs, eos):
    counts = torch.zeros(V + 1, V + 1)
    for t1, t2, t3 in seqs:
        if t1 == eos:
            counts[V, V] += 1
        elif t2 == eos:
            counts[eos, V] += 1
        else:
            counts[t2, t3] += 1
    return counts


def test_exact_sampling_with_chains_ending_at_eos():
    target = tiny_llama(layers=2, seed=3, vocab=V, hidden=16)
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)
    drafter = noisy_copy(target, 0.6, seed=9)
    prompt = torch.tensor([[1, 5, 3, 6]])
    sampling = mmspec.SamplingConfig(1.0)
    eos = int(joint_23(drafter, prompt, sampling).sum(1).argmax())  # the drafter's likeliest token 2
    expected = joint_with_eos(target, prompt, sampling, eos)
    g = torch.Generator().manual_seed(11)
    seqs, cut = [], 0
    d = ModelDrafter(drafter, 3)
    for _ in range(N):
        out = mmspec.speculative_generate(target, d, prompt, acceptance="exact", temperature=1.0, max_new_tokens=3,
                                          generator=g, eos_token_id=eos, pad_token_id=0)
        seqs.append(out.sequences[0, 4:].tolist() + [0] * (3 - out.stats.new_tokens[0]))
        cut += any(n < 3 for n in out.stats.nodes_per_step)
    assert cut > N // 10  # chains really ended early in many requests
    assert chi_square_p(outcome_counts(seqs, eos), expected, N) > 1e-4
    # power: the drafter's own distribution is told apart at this sample size
    wrong = joint_with_eos(drafter, prompt, sampling, eos)
    draws = torch.multinomial(wrong.flatten(), N, replacement=True, generator=torch.Generator().manual_seed(5))
    assert chi_square_p(torch.bincount(draws, minlength=(V + 1) ** 2).view(V + 1, V + 1), expected, N) < 1e-4
