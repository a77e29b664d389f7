"""Bad inputs are refused with a TypeError/ValueError that names the offending argument and
says what to do, never a crash from deep inside torch/transformers or a silent wrong answer.
One table: each row builds the bad call from tiny float64 models (vocabulary 40)."""

from __future__ import annotations

import math

import pytest
import torch

import mmspec
from mmspec.acceptance import ExactAcceptance, get_rule
from mmspec.drafters import ModelDrafter
from mmspec.models.hf_generate import speculative_decoding
from mmspec import sampling
from mmspec.sampling import SamplingConfig

from conftest import VOCAB, left_padded, tiny_llama


@pytest.fixture(scope="module")
def models():
    return tiny_llama(layers=1, seed=0), tiny_llama(layers=1, seed=1)


def _generate(models, drafter=None, input_ids=None, **kw):
    target, small = models
    ids, mask = input_ids or left_padded([4, 3])
    args = dict(temperature=1.0, max_new_tokens=3, generator=torch.Generator().manual_seed(0))
    args.update(kw)
    return mmspec.speculative_generate(target, drafter or ModelDrafter(small, 2), ids, mask, **args)


def _ids_with(token: int):
    """A left-padded batch of two prompts whose second row holds `token` at its last position."""
    ids, mask = left_padded([4, 3])
    ids = ids.clone()
    ids[1, -1] = token
    return ids, mask


_NAN_PROBS = torch.tensor([[0.5, float("nan"), 0.5]])
_INF_PROBS = torch.tensor([[0.5, float("inf"), 0.5]])

CASES = [
    # (id, call(models), exception, message pattern)
    ("tree-depth-float", lambda m: mmspec.TreeConfig(depth=2.5), TypeError, r"TreeConfig\.depth must be an int"),
    ("tree-top_k-bool", lambda m: mmspec.TreeConfig(top_k=True), TypeError, r"TreeConfig\.top_k must be an int"),
    ("tree-num_nodes-str", lambda m: mmspec.TreeConfig(num_nodes="8"), TypeError, r"TreeConfig\.num_nodes"),
    ("tree-top_k-over-vocab",
     lambda m: ModelDrafter(m[1], tree=mmspec.TreeConfig(depth=2, top_k=50, num_nodes=8)),
     ValueError, r"top_k=50 exceeds the drafter's vocabulary of 40"),
    ("drafter-K-bool", lambda m: ModelDrafter(m[1], True), TypeError, r"num_draft_tokens must be an int"),
    ("drafter-K-float", lambda m: ModelDrafter(m[1], 2.0), TypeError, r"num_draft_tokens must be an int"),
    ("drafter-K-with-tree",
     lambda m: ModelDrafter(m[1], 3, tree=mmspec.TreeConfig(depth=2, top_k=2, num_nodes=4)),
     ValueError, r"num_draft_tokens=3 has no effect with tree="),
    ("temperature-nan", lambda m: SamplingConfig(temperature=math.nan), ValueError, r"temperature must be a finite"),
    ("temperature-inf", lambda m: SamplingConfig(temperature=math.inf), ValueError, r"temperature must be a finite"),
    ("temperature-nan-generate", lambda m: _generate(m, temperature=math.nan), ValueError, r"temperature"),
    ("top_k-bool", lambda m: SamplingConfig(top_k=True), ValueError, r"top_k must be None or an int"),
    ("top_k-bool-generate", lambda m: _generate(m, top_k=True), ValueError, r"top_k"),
    ("top_p-nan", lambda m: SamplingConfig(top_p=math.nan), ValueError, r"top_p must be None or a number in \(0, 1\]"),
    ("top_p-bool", lambda m: SamplingConfig(top_p=True), ValueError, r"top_p must be None"),
    ("rule-class", lambda m: get_rule(ExactAcceptance), TypeError, r"ExactAcceptance is a class; pass an instance"),
    ("rule-class-generate", lambda m: _generate(m, acceptance=ExactAcceptance), TypeError, r"pass an instance"),
    ("lantern-no-codebook", lambda m: get_rule("lantern"), ValueError, r"'lantern' needs its codebook.*acceptance_kwargs"),
    ("lantern-no-codebook-generate", lambda m: _generate(m, acceptance="lantern"), ValueError, r"codebook"),
    ("gsd-no-embeddings", lambda m: get_rule("gsd"), ValueError, r"'gsd' needs its embeddings.*acceptance_kwargs"),
    ("cluster-no-labels", lambda m: get_rule("cluster_exact"), ValueError, r"'cluster_exact' needs its labels"),
    ("rule-unknown-kwarg", lambda m: get_rule("typical", epsilonn=0.1), TypeError, r"'typical' takes no argument.*epsilonn"),
    ("input-id-over-vocab", lambda m: _generate(m, input_ids=_ids_with(VOCAB)), ValueError,
     rf"token id {VOCAB}, outside the model's vocabulary of {VOCAB} embeddings"),
    ("input-id-negative", lambda m: _generate(m, input_ids=_ids_with(-1)), ValueError, r"token id -1, outside"),
    ("input-id-over-vocab-hf-generate", lambda m: m[0].generate(
        input_ids=_ids_with(VOCAB + 3)[0], attention_mask=_ids_with(VOCAB + 3)[1], do_sample=False, max_new_tokens=3,
        pad_token_id=0, custom_generate=speculative_decoding, drafter=ModelDrafter(m[1], 2)),
     ValueError, rf"token id {VOCAB + 3}, outside"),
    ("rule-object-with-kwargs", lambda m: get_rule(ExactAcceptance(), k=3), ValueError, r"by name only"),
    ("probs-nan", lambda m: sampling.check_finite_probs(_NAN_PROBS, "drafter probabilities"), ValueError,
     r"drafter probabilities contain NaN"),
    ("probs-inf", lambda m: sampling.check_finite_probs(_INF_PROBS, "target probabilities"), ValueError,
     r"target probabilities contain inf"),
]


@pytest.mark.parametrize("call,exc,pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_refused_clearly(models, call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call(models)


def test_good_inputs_still_pass(models):
    """The checks refuse only what they should: the valid neighbours of the rows above work."""
    assert mmspec.TreeConfig(depth=2, top_k=4, num_nodes=8).top_k == 4
    ModelDrafter(models[1], tree=mmspec.TreeConfig(depth=2, top_k=VOCAB, num_nodes=8))  # top_k == V is fine
    default = ModelDrafter(models[1])  # chains default to the adaptive draft length, at most 8
    assert default.adaptive and default.num_draft_tokens == 8 and ModelDrafter(models[1], 0).num_draft_tokens == 0
    assert SamplingConfig(temperature=0, top_k=3, top_p=1).greedy
    codebook = torch.randn(VOCAB, 4, generator=torch.Generator().manual_seed(0))
    assert get_rule("lantern", codebook=codebook, k=5).__class__.__name__ == "LanternAcceptance"
    probs = torch.softmax(torch.randn(2, 5, dtype=torch.float64), -1)
    assert sampling.check_finite_probs(probs, "x") is probs
    out = _generate(models, acceptance=get_rule("typical", epsilon=0.1))
    assert out.sequences.shape == (2, 4 + 3)
    edge = _generate(models, input_ids=_ids_with(VOCAB - 1), temperature=0)  # the last id is in the vocabulary
    assert edge.sequences.shape == (2, 4 + 3)


def test_multimodal_placeholder_ids_past_the_embedding_are_not_refused():
    """A family whose forward swaps its image token out before embedding may use an id past the
    embedding; the prompt-id check lets exactly that id through and still refuses its neighbour."""
    from mmspec.models.hf_spec import HFSpec

    model = tiny_llama(layers=1, seed=0)
    model.config.image_token_id = VOCAB + 5
    spec = HFSpec(model)
    ids, _ = _ids_with(VOCAB + 5)
    spec._check_token_ids(ids)  # the placeholder passes
    with pytest.raises(ValueError, match=rf"token id {VOCAB + 4}, outside"):
        spec._check_token_ids(_ids_with(VOCAB + 4)[0])
    model.config.image_token_id = 3  # inside the vocabulary: nothing is exempted
    with pytest.raises(ValueError, match=rf"token id {VOCAB + 5}, outside"):
        HFSpec(model)._check_token_ids(ids)


def test_kernel_measurement_leaves_the_global_random_stream_alone():
    """With generator=None sampling draws from torch's global stream, as generate does; the
    first call on a model also timed kernels on random inputs drawn from that stream, so
    torch.manual_seed(s) gave other samples on the first call than on later ones."""
    from conftest import left_padded, tiny_llama
    from mmspec.drafters.null_drafter import NullDrafter

    ids, mask = left_padded([5, 3, 4])
    model = tiny_llama(2, 0).float()  # float32 on CPU: prepack="auto" measures the kernels
    outs = []
    for _ in range(3):
        torch.manual_seed(0)
        outs.append(mmspec.speculative_generate(model, NullDrafter(model.config.vocab_size), ids, mask,
                                                max_new_tokens=8, temperature=1.0).sequences)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
    fresh = tiny_llama(2, 1).float()
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    mmspec.speculative_generate(fresh, NullDrafter(fresh.config.vocab_size), ids, mask, max_new_tokens=4, temperature=0)
    assert torch.equal(torch.rand(3), expected)  # a greedy call draws nothing from it


def test_zero_new_tokens_still_checks_the_model_inputs():
    """max_new_tokens=0 returned before the target saw its inputs: a misspelt option or an image
    on a text model passed there and was refused at 4 tokens."""
    from conftest import left_padded, tiny_llama
    from mmspec.drafters.null_drafter import NullDrafter

    model = tiny_llama(2, 0)
    ids, mask = left_padded([5, 3])
    drafter = NullDrafter(model.config.vocab_size)
    for extra in (dict(temprature=0.5), dict(pixel_values=torch.zeros(2, 3, 8, 8))):
        for n in (0, 4):
            with pytest.raises(ValueError, match="forward takes no argument"):
                mmspec.speculative_generate(model, drafter, ids, mask, max_new_tokens=n, **extra)
    out = mmspec.speculative_generate(model, drafter, ids, mask, max_new_tokens=0)
    assert torch.equal(out.sequences, ids)


def test_zero_new_tokens_checks_through_the_target_protocol():
    """At max_new_tokens=0 the loop asks the target's optional `check_inputs` (it reached for
    `target.spec` / `target.target.spec` before, so other wrapping targets went unchecked):
    through GuidedTarget, and through a user's own wrapper that declares it."""
    from conftest import left_padded, tiny_llama
    from mmspec import GuidedTarget
    from mmspec.drafters.null_drafter import NullDrafter
    from mmspec.models import HFTarget

    model = tiny_llama(2, 0)
    ids, mask = left_padded([5, 3])
    drafter = NullDrafter(model.config.vocab_size)
    guided = GuidedTarget(model, 2.0, uncond_input_ids=torch.ones(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="forward takes no argument"):
        mmspec.speculative_generate(guided, drafter, ids, mask, max_new_tokens=0, pixel_values=torch.zeros(2, 3))

    class Wrapper:  # delegates the protocol, and checks inputs its own way
        def __init__(self, inner):
            self.inner, self.vocab_size, self.seen = inner, inner.vocab_size, []

        def check_inputs(self, input_ids, attention_mask, model_inputs):
            self.seen.append(sorted(model_inputs))
            raise ValueError("wrapper refuses " + ", ".join(sorted(model_inputs)))

        def __getattr__(self, name):
            return getattr(self.inner, name)

    wrapper = Wrapper(HFTarget(model))
    with pytest.raises(ValueError, match="wrapper refuses extra_option"):
        mmspec.speculative_generate(wrapper, drafter, ids, mask, max_new_tokens=0, extra_option=1)
    assert wrapper.seen == [["extra_option"]]
    assert torch.equal(mmspec.speculative_generate(wrapper, drafter, ids, mask, max_new_tokens=0).sequences, ids)


def test_numpy_integers_are_taken_as_the_numbers_they_hold():
    """np.int64(3) (from configs, sweeps, np.arange) was refused as "must be an int" by the
    drafters, TreeConfig and NullDrafter; it means 3."""
    import numpy as np

    from conftest import tiny_llama
    from mmspec.drafters import EagleHead, EagleHeadConfig, EagleHeadDrafter
    from mmspec.drafters.null_drafter import NullDrafter

    model = tiny_llama(1, 0)
    assert ModelDrafter(model, np.int64(3)).num_draft_tokens == 3
    assert ModelDrafter(model, "auto", max_draft_tokens=np.int64(4)).max_draft_nodes == 4
    tree = mmspec.TreeConfig(depth=np.int64(3), top_k=np.int32(2), num_nodes=np.int64(6))
    assert (tree.depth, tree.top_k, tree.num_nodes) == (3, 2, 6) and type(tree.num_nodes) is int
    assert NullDrafter(np.int64(5)).vocab_size == 5
    head = EagleHead(EagleHeadConfig.for_target(model))
    assert EagleHeadDrafter(model, head, np.int64(2)).num_draft_tokens == 2
    with pytest.raises(TypeError, match="must be an int"):
        ModelDrafter(model, np.float64(3.0))  # a float is still not a draft length
