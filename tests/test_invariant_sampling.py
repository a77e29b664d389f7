"""acceptance="invariant": sampled output that does not depend on the drafter.

- For a seed, every drafter (none, a small model at fixed and scripted K including K = 0 steps,
  a dynamic tree, Jacobi windows with each coupling) emits exactly the tokens of plain decoding
  with the same rule: float64, batch of 4 prompts of different lengths, rows ending at EOS,
  temperature / top-k / top-p.
- Those tokens are distributed like the target: chi-square against the enumerated joint of two
  tokens, with a planted bug (noise shared by positions) that must fail the same test.
- `PositionNoise`: a position's noise does not depend on how the positions are asked for;
  rows and positions get independent Gumbel(0, 1) noise (KS test).
- The rule alone refuses targets that are not one-hot; at temperature 0 it is greedy.
- The image pipeline: `speculative=True` gives the images of `speculative=False` for a seed,
  with Jacobi windows chosen by timing ("auto") and with the small-model drafter.
"""

from __future__ import annotations

import pytest
import torch
from scipy import stats as sps

import mmspec
from mmspec.acceptance import DrafterInvariantAcceptance, GreedyAcceptance, get_rule
from mmspec.drafters import JacobiDrafter, ModelDrafter, NullDrafter
from mmspec.position_noise import PositionNoise

from conftest import left_padded, noisy_copy, tiny_llama
from test_core_adaptive_batch import ScriptedRecorder
from test_core_sampling import chi_square_p, joint_23
from test_vlm_llava import llava  # noqa: F401 (fixture)

V = 40


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(layers=2, seed=0)
    return target, noisy_copy(target, 0.3)


def _drafters(small):
    scripted = ModelDrafter(small, "auto", max_draft_tokens=4)
    scripted.controller = ScriptedRecorder([3, 0, 0, 4, 1, 0, 2])
    return {
        "model-k3": ModelDrafter(small, 3),
        "model-k6": ModelDrafter(small, 6),
        "model-scripted-k": scripted,
        "tree": ModelDrafter(small, tree=mmspec.TreeConfig(depth=3, top_k=2, num_nodes=6)),
        "jacobi-gumbel": JacobiDrafter(5, "gumbel", vocab_size=V),
        "jacobi-maximal": JacobiDrafter(4, "maximal", vocab_size=V),
        "jacobi-uncoupled": JacobiDrafter(3, None, vocab_size=V),
    }


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_k=6),
                                      dict(temperature=1.3, top_p=0.8)], ids=["T1", "T0.7-topk", "T1.3-topp"])
def test_every_drafter_emits_the_tokens_of_plain_decoding(pair, sampling):
    target, small = pair
    ids, mask = left_padded([5, 9, 3, 7])

    def run(drafter):
        return mmspec.speculative_generate(target, drafter, ids, mask, acceptance="invariant", max_new_tokens=24,
                                           eos_token_id=5, pad_token_id=0,
                                           generator=torch.Generator().manual_seed(11), **sampling)

    plain = run(NullDrafter(V))
    assert plain.stats.lossless
    other_seed = mmspec.speculative_generate(target, NullDrafter(V), ids, mask, acceptance="invariant",
                                             max_new_tokens=24, eos_token_id=5, pad_token_id=0,
                                             generator=torch.Generator().manual_seed(12), **sampling)
    assert not torch.equal(other_seed.sequences, plain.sequences)  # the seed matters
    accepted = {}
    for name, drafter in _drafters(small).items():
        out = run(drafter)
        assert torch.equal(out.sequences, plain.sequences), name
        assert out.stats.new_tokens == plain.stats.new_tokens, name
        accepted[name] = out.stats.accepted_drafts
    # Drafts were accepted (the drafters see the verifier's noise): fewer forwards than tokens.
    assert accepted["model-k3"] > 0 and accepted["jacobi-gumbel"] > 0
    # Plain decoding with "exact" draws other tokens for the seed: the invariance is the rule's.
    exact = mmspec.speculative_generate(target, _drafters(small)["model-k3"], ids, mask, acceptance="exact",
                                        max_new_tokens=24, eos_token_id=5, pad_token_id=0,
                                        generator=torch.Generator().manual_seed(11), **sampling)
    assert not torch.equal(exact.sequences, plain.sequences)


def test_small_model_drafts_use_the_verifiers_noise(pair):
    """With the loop's noise the drafter proposes argmax(log q + g): a drafter equal to the
    target is then accepted at every position."""
    target, _ = pair
    ids, mask = left_padded([6, 4])
    out = mmspec.speculative_generate(target, ModelDrafter(target, 4), ids, mask, acceptance="invariant",
                                      max_new_tokens=21, generator=torch.Generator().manual_seed(3))
    assert out.stats.accepted_drafts == out.stats.drafted_nodes > 0
    # Trees rank each level by log q - log E (Gumbel top-k): the best path is the chain, accepted
    # to the full depth (without the noise a top-k tree of the same drafter accepts ~1 in 20 here).
    tree = mmspec.TreeConfig(depth=3, top_k=2, num_nodes=6)
    out = mmspec.speculative_generate(target, ModelDrafter(target, tree=tree), ids, mask, acceptance="invariant",
                                      max_new_tokens=21, generator=torch.Generator().manual_seed(3))
    assert out.stats.verified_accepted / out.stats.row_steps > 2.5  # depth 3 (the last steps have fewer left)


SAMPLES = 12000
VS = 8


@pytest.fixture(scope="module")
def sharp_pair():
    target = tiny_llama(layers=2, seed=3, vocab=VS, hidden=16)
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)
    return target, noisy_copy(target, 0.6, seed=9)


def _joint_counts(target, drafter, sampling):
    prompt = torch.tensor([[1, 5, 3, 6]])
    out = mmspec.speculative_generate(target, drafter, prompt.expand(SAMPLES, -1), acceptance="invariant",
                                      max_new_tokens=3, generator=torch.Generator().manual_seed(2024),
                                      temperature=sampling.temperature, top_k=sampling.top_k)
    new = out.sequences[:, 4:]
    counts = torch.zeros(VS, VS)
    counts.index_put_((new[:, 1], new[:, 2]), torch.ones(SAMPLES), accumulate=True)
    return counts, joint_23(target, prompt, sampling), out


@pytest.mark.parametrize("temperature,top_k", [(1.0, None), (0.7, 5)], ids=["T1", "T0.7-topk5"])
def test_invariant_sampling_is_distributed_like_the_target(sharp_pair, temperature, top_k):
    target, small = sharp_pair
    sampling = mmspec.SamplingConfig(temperature, top_k)
    counts, expected, out = _joint_counts(target, ModelDrafter(small, 3), sampling)
    assert 0 < out.stats.accepted_drafts < out.stats.drafted_nodes  # acceptances and rejections both happen
    assert chi_square_p(counts, expected, SAMPLES) > 1e-4


def test_planted_bug_noise_shared_by_positions_fails_the_same_check(sharp_pair, monkeypatch):
    """Power: the same noise at every position of a row couples token 2 to token 3; the check
    above must see it."""
    target, small = sharp_pair
    original = PositionNoise.race

    def same_for_every_position(self, rows, starts, length, **kw):
        return original(self, rows, [0] * len(rows), 1, **kw).expand(-1, length, -1)

    monkeypatch.setattr(PositionNoise, "race", same_for_every_position)
    sampling = mmspec.SamplingConfig(1.0, None)
    counts, expected, _ = _joint_counts(target, NullDrafter(VS), sampling)
    assert chi_square_p(counts, expected, SAMPLES) < 1e-6


def test_position_noise_is_keyed_by_row_and_position_only():
    noise = PositionNoise(1234, 7)
    whole = noise.gumbel([0, 3], [0, 5], 40, dtype=torch.float64)
    again = PositionNoise(1234, 7)
    parts = torch.cat([again.gumbel([0, 3], [s, s + 5], n, dtype=torch.float64)
                       for s, n in ((0, 3), (3, 14), (17, 23))], 1)
    assert torch.equal(whole, parts)
    assert torch.equal(PositionNoise(1234, 7).gumbel([3], [5], 4, dtype=torch.float64), whole[1:, :4])
    assert not torch.equal(whole[0], whole[1])
    assert not torch.equal(PositionNoise(1235, 7).gumbel([0], [0], 40, dtype=torch.float64), whole[:1])
    # Gumbel(0, 1): KS against its CDF exp(-exp(-x)) over many rows and positions.
    big = PositionNoise(7, 50).gumbel(list(range(20)), [3] * 20, 30, dtype=torch.float64).flatten()
    assert sps.kstest(big.numpy(), sps.gumbel_r.cdf).pvalue > 1e-3
    # The race form: E = exp(-g) is Exp(1), and argmax(p / E) = argmax(log p + g).
    race = PositionNoise(7, 50).race([4], [3], 30, dtype=torch.float64)
    assert torch.allclose(race.log(), -PositionNoise(7, 50).gumbel([4], [3], 30, dtype=torch.float64))
    p = torch.softmax(torch.randn(1, 30, 50, dtype=torch.float64), -1)
    assert torch.equal(PositionNoise(7, 50).perturb(p, [4], [3]).argmax(-1), (p.log() - race.log()).argmax(-1))
    with pytest.raises(ValueError, match="seed"):
        PositionNoise(-1, 7)


def test_rule_alone_refuses_targets_that_are_not_one_hot_and_is_greedy_at_temperature_zero():
    rule = get_rule("invariant")
    assert isinstance(rule, DrafterInvariantAcceptance) and rule.lossless
    p = torch.softmax(torch.randn(2, 3, 6), -1)
    with pytest.raises(ValueError, match="one-hot"):
        rule.verify(torch.zeros(2, 2, dtype=torch.long), None, p)
    one_hot = torch.nn.functional.one_hot(torch.tensor([[1, 2, 3], [4, 4, 0]]), 6).double()
    res = rule.verify(torch.tensor([[1, 5], [4, 4]]), None, one_hot)
    assert res.num_accepted.tolist() == [1, 2] and res.next_tokens.tolist() == [2, 0]
    assert isinstance(rule.at_temperature_zero(), GreedyAcceptance)
    from mmspec.acceptance import is_position_keyed

    assert is_position_keyed("invariant") and is_position_keyed(rule)
    assert not is_position_keyed("exact") and not is_position_keyed(GreedyAcceptance()) and not is_position_keyed("nope")


def test_greedy_decoding_with_the_rule_is_greedy(pair):
    target, small = pair
    ids, mask = left_padded([5, 9])
    a = mmspec.speculative_generate(target, ModelDrafter(small, 3), ids, mask, acceptance="invariant", temperature=0,
                                    max_new_tokens=12)
    ref = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=0)
    assert torch.equal(a.sequences, ref)


@pytest.mark.parametrize("drafter", ["jacobi-auto", "model"])
def test_image_pipeline_speculative_images_equal_plain_images_for_a_seed(drafter):
    from test_ar_image_pipeline import make_pipe

    pipe = make_pipe(torch.float64)
    if drafter == "jacobi-auto":
        pipe.drafter = JacobiDrafter("auto", "gumbel", max_window=8)
    kw = dict(guidance_scale=3.0, acceptance="invariant", output_type="latent")
    for seed in (0, 1, 2):  # several requests, so the auto window moves between them
        plain = pipe([0, 3, 1, 4], speculative=False, generator=torch.Generator().manual_seed(seed), **kw)
        spec = pipe([0, 3, 1, 4], speculative=True, generator=torch.Generator().manual_seed(seed), **kw)
        assert torch.equal(spec.tokens, plain.tokens), seed
        assert plain.stats.target_forwards_per_image == 16.0
    exact = pipe([0, 3, 1, 4], speculative=False, generator=torch.Generator().manual_seed(2), guidance_scale=3.0,
                 output_type="latent")
    assert not torch.equal(exact.tokens, plain.tokens)  # "exact" plain sampling draws differently


@pytest.mark.parametrize("kind", ["eagle", "vispec"])
def test_llava_feature_drafters_emit_the_tokens_of_plain_decoding(llava, kind):
    """EAGLE / ViSpec heads on LLaVA (images, prompts of different lengths): chains draft with the
    verifier's noise, trees keep their top-k nodes; both emit plain decoding's tokens."""
    from test_drafters_eagle import TREE, make
    from test_vlm_llava import llava_batch

    model, _ = llava
    ids, mask, pixels = llava_batch([(1, 2), (4, 1), (2, 5), (6, 3)], seed=7)
    kw = dict(acceptance="invariant", temperature=0.9, max_new_tokens=14, pixel_values=pixels, pad_token_id=0)
    plain = mmspec.speculative_generate(model, NullDrafter(model.config.text_config.vocab_size), ids, mask,
                                        generator=torch.Generator().manual_seed(4), **kw)
    for tree in (None, TREE):
        out = mmspec.speculative_generate(model, make(model, kind, tree), ids, mask,
                                          generator=torch.Generator().manual_seed(4), **kw)
        assert torch.equal(out.sequences, plain.sequences), tree


def test_the_loops_token_path_equals_the_rules_one_hot_verification():
    """The loop verifies chains from the perturbed argmax tokens (`verify_top`), and a position-keyed
    rule without that method through its own walk over one-hots: the same verdicts."""
    from mmspec.position_noise import PositionNoise
    from mmspec.tree import chain_parents
    from mmspec.types import Draft

    class OwnWalk(DrafterInvariantAcceptance):
        verify_top = property(lambda self: (_ for _ in ()).throw(AttributeError("verify_top")))

    noise = PositionNoise(9, 6)
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(5, 4, 6, generator=g, dtype=torch.float64) * 2, -1)
    top = noise.argmax(probs, list(range(5)), [2] * 5)
    tokens = top[:, :3].clone()
    tokens[1, 0] = (tokens[1, 0] + 1) % 6  # row 1 rejected at once, row 3 at the last draft
    tokens[3, 2] = (tokens[3, 2] + 1) % 6
    draft = Draft(tokens=tokens, parents=chain_parents(5, 3), draft_probs=None)
    for rule in (DrafterInvariantAcceptance(), OwnWalk()):
        v = noise.verdict(rule, draft, probs, list(range(5)), [2] * 5)
        assert v.num_accepted.tolist() == [3, 0, 3, 2, 3]
        assert torch.equal(v.next_tokens, top.gather(1, v.num_accepted.unsqueeze(1)).squeeze(1))
