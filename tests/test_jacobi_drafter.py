"""Jacobi drafting (SJD, coupled SCD/MC-SJD drafts) and CFG model drafting on LlamaGen GPTs:
greedy output equals the plain sampler's (batch of 4 mixed classes, with and without CFG);
exact sampling with CFG is distributed like plain guided sampling (chi-square against the
enumerated guided joint of a tiny codebook, with power checks: a planted coupling bug and the
unguided joint are rejected); coupled drafts accept more per forward than uncoupled ones."""

from __future__ import annotations

import pytest
import torch

import mmspec
from mmspec.drafters import GuidedModelDrafter, JacobiDrafter, ModelDrafter
from mmspec.models.llamagen_spec import LlamaGenSpec, cfg_schedule_fn, llamagen_target, null_class_uncond
from mmspec.sampling import sample_from

from _llamagen_helpers import LABELS, NUM_CLASSES, noisy_gpt, plain_greedy, tiny_gpt
from test_core_sampling import chi_square_p

T = 16


def run(target, drafter, labels=LABELS, n=T, **kw):
    out = mmspec.speculative_generate(target, drafter, labels.view(-1, 1), max_new_tokens=n, **kw)
    return out.sequences[:, 1:], out.stats


@pytest.mark.parametrize("cfg", [(1.0, "constant"), (3.0, "constant"), (4.0, "linear")], ids=["nocfg", "cfg", "linear"])
@pytest.mark.parametrize("coupling,init", [(None, "random"), ("maximal", "random"), ("gumbel", "last")])
def test_jacobi_greedy_equals_plain(cfg, coupling, init):
    gpt = tiny_gpt(0)
    scale, schedule = cfg
    ref = plain_greedy(gpt, scale=scale, schedule=schedule)
    drafter = JacobiDrafter(5, coupling, init, vocab_size=gpt.args.vocab_size)
    tokens, stats = run(llamagen_target(gpt, scale, cfg_schedule=schedule, num_tokens=T), drafter, temperature=0,
                        generator=torch.Generator().manual_seed(0))
    assert torch.equal(tokens, ref)
    assert stats.drafted_nodes > 0 and stats.draft_calls == 0


def test_jacobi_greedy_converges_on_a_peaked_model():
    """Jacobi iteration accepts several tokens per forward when the model is nearly deterministic
    (large logits), and stays exactly the plain greedy output."""
    gpt = tiny_gpt(4, scale=0.8)
    ref = plain_greedy(gpt, scale=2.0)
    tokens, stats = run(llamagen_target(gpt, 2.0), JacobiDrafter(8, "gumbel", vocab_size=24), temperature=0)
    assert torch.equal(tokens, ref)
    assert stats.mean_accepted_length > 1.0


@pytest.mark.parametrize("tree", [None, mmspec.TreeConfig(depth=3, top_k=2, num_nodes=6)], ids=["chain", "tree"])
@pytest.mark.parametrize("cfg", [(3.0, "constant"), (4.0, "linear")], ids=["cfg", "linear"])
def test_guided_model_drafter_greedy_equals_plain_and_drafts_under_guidance(tree, cfg):
    gpt = tiny_gpt(0)
    scale, schedule = cfg
    ref = plain_greedy(gpt, scale=scale, schedule=schedule)
    target = llamagen_target(gpt, scale, cfg_schedule=schedule, num_tokens=T)
    guided = GuidedModelDrafter(LlamaGenSpec(gpt), cfg_schedule_fn(schedule, scale, T), None if tree else 3, tree,
                                make_uncond=null_class_uncond(NUM_CLASSES))
    tokens, stats = run(target, guided, temperature=0)
    assert torch.equal(tokens, ref)
    # The drafter is the target's own GPT: under the same guidance every draft is accepted;
    # drafting from the conditional logits alone is not (guidance changes the argmax).
    unguided_tokens, unguided = run(llamagen_target(gpt, scale, cfg_schedule=schedule, num_tokens=T),
                                    ModelDrafter(LlamaGenSpec(gpt), tree=tree) if tree else ModelDrafter(LlamaGenSpec(gpt), 3),
                                    temperature=0)
    assert torch.equal(unguided_tokens, ref)
    assert stats.mean_accepted_length > unguided.mean_accepted_length + 0.5
    assert stats.target_calls < unguided.target_calls


def test_guided_model_drafter_noisy_drafter_rows_leave():
    """Rows with different acceptance leave together with their unconditional halves (select_rows)."""
    gpt = tiny_gpt(0)
    ref = plain_greedy(gpt, scale=3.0, n=11)
    drafter = GuidedModelDrafter(LlamaGenSpec(noisy_gpt(gpt, 0.4)), 3.0, 4, make_uncond=null_class_uncond(NUM_CLASSES))
    tokens, _ = run(llamagen_target(gpt, 3.0), drafter, n=11, temperature=0)
    assert torch.equal(tokens, ref)


# ---------------------------------------------------------------------- exact sampling with CFG
V, TOKENS, SAMPLES, SCALE, LABEL = 5, 4, 8000, 3.0, 2


@torch.no_grad()
def guided_joint(gpt, scale: float, temperature: float = 1.0) -> torch.Tensor:
    """Exact P(t1, t2, t3) [V, V, V] of guided plain sampling (t0 marginalised), enumerated
    with the GPT's teacher-forced forward (not the cached decoding under test)."""
    sampling = mmspec.SamplingConfig(temperature)
    prefixes = torch.cartesian_prod(*[torch.arange(V)] * (TOKENS - 1))  # [V^3, 3]: t0, t1, t2
    n = prefixes.shape[0]
    cond, _ = gpt(prefixes, torch.full((n,), LABEL))
    uncond, _ = gpt(prefixes, torch.full((n,), NUM_CLASSES))
    probs = mmspec.process_logits(uncond + scale * (cond - uncond), sampling)  # [V^3, 4, V]
    joint = probs[0, 0].view(V, 1, 1, 1) * probs[:, 1].gather(1, prefixes[:, 1:2]).view(V, V, V, 1)
    joint = joint * probs[:, 2].gather(1, prefixes[:, 2:3]).view(V, V, V, 1) * probs[:, 3].view(V, V, V, V)
    return joint.sum(0)


def sample_counts(gpt, drafter, scale=SCALE, seed=7) -> tuple[torch.Tensor, mmspec.SpecStats]:
    labels = torch.full((SAMPLES,), LABEL)
    tokens, stats = run(llamagen_target(gpt, scale, num_tokens=TOKENS), drafter, labels, n=TOKENS,
                        temperature=1.0, acceptance="exact", generator=torch.Generator().manual_seed(seed))
    counts = torch.zeros(V, V, V)
    counts.index_put_((tokens[:, 1], tokens[:, 2], tokens[:, 3]), torch.ones(SAMPLES), accumulate=True)
    return counts, stats


def sample_counts_over_requests(gpt, drafter, requests: int, seed=7) -> tuple[torch.Tensor, int]:
    """`sample_counts` split into `requests` calls of one drafter (an adaptive drafter changes
    its choices between them): pooled counts and accepted drafts."""
    gen = torch.Generator().manual_seed(seed)
    counts, accepted, per_call = torch.zeros(V, V, V), 0, SAMPLES // requests
    for _ in range(requests):
        tokens, stats = run(llamagen_target(gpt, SCALE, num_tokens=TOKENS), drafter, torch.full((per_call,), LABEL),
                            n=TOKENS, temperature=1.0, acceptance="exact", generator=gen)
        counts.index_put_((tokens[:, 1], tokens[:, 2], tokens[:, 3]), torch.ones(per_call), accumulate=True)
        accepted += stats.accepted_drafts
    return counts, accepted


class KeepOldDraft(JacobiDrafter):
    """Planted bug: the maximal coupling keeps the previous draft always (drafts then follow
    the old distribution while q_new is reported)."""

    def _maximal_coupling(self, q, N, generator):
        fresh = sample_from(q.reshape(-1, q.shape[-1]), generator).view(q.shape[0], N)
        return torch.where(self.prev_valid[:, :N], self.prev_tokens[:, :N], fresh)


def cfg_gpt():
    return tiny_gpt(3, vocab=V, dim=16, heads=2, block=TOKENS, scale=0.5)


@pytest.mark.parametrize("coupling", [None, "maximal", "gumbel"])
def test_jacobi_exact_sampling_with_cfg_matches_guided_joint(coupling):
    gpt = cfg_gpt()
    expected, unguided = guided_joint(gpt, SCALE), guided_joint(gpt, 1.0)
    counts, stats = sample_counts(gpt, JacobiDrafter(3, coupling, vocab_size=V))
    assert chi_square_p(counts, expected, SAMPLES) > 1e-4
    assert chi_square_p(counts, unguided, SAMPLES) < 1e-6  # power: guidance is visible in these samples
    assert stats.accepted_drafts > SAMPLES // 4  # drafts were accepted (and rejected: not everything)
    assert stats.accepted_drafts < stats.drafted_nodes


def test_planted_coupling_bug_is_detected():
    gpt = cfg_gpt()
    counts, _ = sample_counts(gpt, KeepOldDraft(3, "maximal", vocab_size=V))
    assert chi_square_p(counts, guided_joint(gpt, SCALE), SAMPLES) < 1e-6


def test_guided_model_drafter_exact_sampling_matches_guided_joint():
    gpt = cfg_gpt()
    drafter = GuidedModelDrafter(LlamaGenSpec(noisy_gpt(gpt, 0.5)), SCALE, 3, make_uncond=null_class_uncond(NUM_CLASSES))
    counts, stats = sample_counts(gpt, drafter)
    assert chi_square_p(counts, guided_joint(gpt, SCALE), SAMPLES) > 1e-4
    assert 0 < stats.accepted_drafts < stats.drafted_nodes


def test_coupled_drafts_accept_more_per_forward_than_uncoupled():
    """Fixed-seed run (batch 128, 16 tokens, CFG, temperature 1) on a Markov GPT (attention
    output zeroed: the next token depends only on the current one, the extreme of smooth image
    regions). Uncoupled SJD resamples every window position each iteration, so the target's
    outputs downstream of it are stale; coupled drafts keep what still fits. Measured over
    seeds 0-2: uncoupled 1.16-1.18 tokens per forward, maximal 1.28-1.33, Gumbel 1.27-1.29
    (seed-to-seed spread ~0.02), so the 0.05 margin is several spreads from both sides."""
    gpt = tiny_gpt(4, scale=0.6)
    with torch.no_grad():
        for layer in gpt.layers:
            layer.attention.wo.weight.zero_()
    labels = torch.arange(128) % NUM_CLASSES
    length = {}
    for coupling in (None, "maximal", "gumbel"):
        _, stats = run(llamagen_target(gpt, 2.0), JacobiDrafter(6, coupling, vocab_size=24), labels,
                       temperature=1.0, generator=torch.Generator().manual_seed(0))
        length[coupling] = stats.mean_accepted_length
    assert length["maximal"] > length[None] + 0.05 and length["gumbel"] > length[None] + 0.05, length


def test_jacobi_refusals():
    with pytest.raises(ValueError, match="coupling"):
        JacobiDrafter(4, "optimal")
    with pytest.raises(ValueError, match="window"):
        JacobiDrafter(0)
    with pytest.raises(ValueError, match="init"):
        JacobiDrafter(4, init="zeros")
    for bad in (0, True, 24.0):  # were accepted, and surfaced (if at all) as a vocabulary mismatch later
        with pytest.raises(ValueError, match="vocab_size must be None .set by the pipeline. or an int >= 1"):
            JacobiDrafter(4, vocab_size=bad)
    from mmspec.drafters import NullDrafter

    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="vocab_size must be an int >= 1"):
            NullDrafter(bad)
    gpt = tiny_gpt(0)
    with pytest.raises(ValueError, match="vocab"):
        run(llamagen_target(gpt), JacobiDrafter(4, vocab_size=7), temperature=0)
    with pytest.raises(ValueError, match="JacobiDrafter has no vocab_size: build it with vocab_size=24"):
        run(llamagen_target(gpt), JacobiDrafter(4), temperature=0)  # said "drafter vocabulary (None) differs"


def test_jacobi_on_a_language_model_with_eos_rows_leaving(target):
    """Any target: a tiny HF Llama, left-padded batch, an EOS that ends rows at different steps
    (select_rows) -- greedy Jacobi output equals plain decoding (NullDrafter) token for token."""
    from mmspec.drafters import NullDrafter

    from conftest import VOCAB, left_padded

    ids, mask = left_padded([6, 4, 5, 3])
    plain = mmspec.speculative_generate(target, NullDrafter(VOCAB), ids, mask, temperature=0, max_new_tokens=20)
    eos = int(plain.sequences[1, ids.shape[1] + 4])  # row 1 ends by its 5th token
    ref = mmspec.speculative_generate(target, NullDrafter(VOCAB), ids, mask, temperature=0, max_new_tokens=20,
                                      eos_token_id=eos, pad_token_id=0)
    out = mmspec.speculative_generate(target, JacobiDrafter(4, "maximal", vocab_size=VOCAB), ids, mask,
                                      temperature=0, max_new_tokens=20, eos_token_id=eos, pad_token_id=0,
                                      generator=torch.Generator().manual_seed(0))
    assert torch.equal(out.sequences, ref.sequences)
    assert len(set(ref.stats.new_tokens)) > 1  # rows left at different steps


def _coupled_draws(drafter: JacobiDrafter, q: torch.Tensor, q_old: torch.Tensor, rows: int, valid: bool, seed: int):
    """`rows` independent one-slot windows whose previous draft y ~ q_old; returns (y, new draft)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.multinomial(q_old, rows, replacement=True, generator=g).view(rows, 1)
    drafter.prev_valid = torch.full((rows, 1), valid)
    drafter.prev_tokens = y
    drafter.prev_q = q_old.view(1, 1, -1).expand(rows, 1, -1)
    return y, drafter._maximal_coupling(q.view(1, 1, -1).expand(rows, 1, -1), 1, g)


def test_maximal_coupling_draws_follow_q_and_keep_as_often_as_possible():
    """The new draft is distributed exactly q (chi-square on 20000 draws) and equals the old draft
    y ~ q_old with probability sum_v min(q, q_old) (the maximal coupling's agreement; a binomial
    tolerance of 4 standard deviations). Power: the old drafts themselves (law q_old) fail the
    same chi-square test, and a slot without an old draft is never 'kept' more than chance."""
    rows = 20000
    q = torch.tensor([0.30, 0.25, 0.20, 0.10, 0.10, 0.05], dtype=torch.float64)
    q_old = torch.tensor([0.05, 0.10, 0.25, 0.30, 0.20, 0.10], dtype=torch.float64)
    drafter = JacobiDrafter(1, "maximal", vocab_size=6)
    y, new = _coupled_draws(drafter, q, q_old, rows, True, seed=3)
    counts = torch.bincount(new.flatten(), minlength=6)
    assert chi_square_p(counts, q, rows) > 1e-4
    assert chi_square_p(torch.bincount(y.flatten(), minlength=6), q, rows) < 1e-6  # power
    agree = float((new == y).double().mean())
    expected = float(torch.minimum(q, q_old).sum())  # 0.55 here
    assert abs(agree - expected) < 4 * (expected * (1 - expected) / rows) ** 0.5, (agree, expected)
    # Slots without a previous draft: a fresh draw from q, equal to y only by chance.
    y, fresh = _coupled_draws(drafter, q, q_old, rows, False, seed=4)
    assert chi_square_p(torch.bincount(fresh.flatten(), minlength=6), q, rows) > 1e-4
    assert float((fresh == y).double().mean()) < expected - 0.2  # chance: sum q * q_old = 0.155
