"""The opt-in GPU path on CPU: static shapes (`static=True`) and `compile=` (torch.compile).

Static mode must change nothing that is generated: greedy output equals `model.generate`
token for token (float64, chains and trees, rows ending at different steps), exact sampling
is distributed like the target. What it changes is shapes: every step forward of a request
sees the same shapes, so a compiled forward is traced once per forward kind (checked with
dynamo's counters, with `fullgraph=True`, which also fails on a host sync inside the region).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import mmspec
from mmspec.drafters import ModelDrafter
from mmspec.models.hf_target import HFTarget
from mmspec.static_kv import SLOT_BUCKET, StaticKV

from conftest import left_padded, tiny_llama
from test_core_sampling import V, chi_square_p, joint_23

LENGTHS = [9, 5, 7, 3]
TREE = mmspec.TreeConfig(depth=3, top_k=3, num_nodes=8)
EAGER = {"backend": "eager", "fullgraph": True}


def reference(model, ids, mask, n, eos):
    return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n, pad_token_id=0,
                          eos_token_id=eos, min_new_tokens=0)


def early_eos(model, ids, mask) -> int:
    """A token row 0 emits early under greedy decoding: rows then end at different steps."""
    return int(reference(model, ids, mask, 24, None)[0, ids.shape[1] + 3])


def drafter_of(model, tree, **kw):
    return ModelDrafter(model, tree=tree, **kw) if tree is not None else ModelDrafter(model, 4, **kw)


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
def test_static_greedy_equals_generate(target, good_drafter, tree):
    ids, mask = left_padded(LENGTHS)
    eos = early_eos(target, ids, mask)
    ref = reference(target, ids, mask, 24, eos)
    tgt = HFTarget(target, static=True)
    out = mmspec.speculative_generate(tgt, drafter_of(good_drafter, tree, static=True), ids, mask, temperature=0,
                                      max_new_tokens=24, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out.sequences, ref)
    rows = out.stats.active_rows
    assert rows[0] == 4 and rows[-1] < 4  # rows ended at different steps ...
    kv = tgt.runner.kv
    assert isinstance(kv, StaticKV) and kv.physical_rows == 4  # ... and stayed as inert padding rows
    assert kv.capacity % SLOT_BUCKET == 0 and len(kv.keys) == 2 and kv.keys[0].shape[2] == kv.capacity
    assert out.stats.mean_accepted_length > 1.3  # drafts were accepted, not just bonus tokens


def test_static_target_with_adaptive_drafter(target, good_drafter):
    """An "auto" drafter changes K per step; the static target still verifies K_max + 1 queries."""
    ids, mask = left_padded(LENGTHS)
    out = mmspec.speculative_generate(HFTarget(target, static=True), ModelDrafter(good_drafter), ids, mask,
                                      temperature=0, max_new_tokens=16, pad_token_id=0, eos_token_id=2)
    assert torch.equal(out.sequences, reference(target, ids, mask, 16, 2))
    assert max(out.stats.nodes_per_step) > 0  # the controller drafted (K varied under a fixed Q)


def test_static_exact_sampling_matches_enumerated_joint():
    target = tiny_llama(layers=2, seed=3, vocab=V, hidden=16)
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)
    from conftest import noisy_copy

    drafter = noisy_copy(target, 0.6, seed=9)
    samples = 6000
    prompt = torch.tensor([[1, 5, 3, 6]])
    sampling = mmspec.SamplingConfig(0.8)
    expected = joint_23(target, prompt, sampling)
    g = torch.Generator().manual_seed(11)
    out = mmspec.speculative_generate(
        HFTarget(target, static=True), ModelDrafter(drafter, 3, static=True), prompt.expand(samples, -1),
        acceptance="exact", temperature=0.8, max_new_tokens=3, generator=g,
    )
    new = out.sequences[:, 4:]
    counts = torch.zeros(V, V)
    counts.index_put_((new[:, 1], new[:, 2]), torch.ones(samples), accumulate=True)
    raw = out.stats.verified_accepted / out.stats.row_steps
    assert 0.2 < raw < 2.5  # rejections and residuals are exercised
    assert chi_square_p(counts, expected, samples) > 1e-4
    # Power at this sample size: the drafter's own joint distribution is rejected.
    draws = torch.multinomial(joint_23(drafter, prompt, sampling).flatten(), samples, replacement=True,
                              generator=torch.Generator().manual_seed(7))
    assert chi_square_p(torch.bincount(draws, minlength=V * V).view(V, V), expected, samples) < 1e-4


class ShapeSpy:
    """Records the input shapes of every step forward a runner makes."""

    def __init__(self, runner):
        self.inner, self.shapes = runner._step, []
        runner._step = self

    def __call__(self, tokens, attention, kv, features, *, last_only=False):
        self.shapes.append((tuple(tokens.shape), tuple(attention.visible.shape), tuple(attention.q_pos.shape),
                            tuple(attention.slot_pos.shape), kv.kv_len, kv.past_len, last_only))
        return self.inner(tokens, attention, kv, features, last_only=last_only)


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
def test_step_shapes_are_static(target, good_drafter, tree):
    ids, mask = left_padded(LENGTHS)
    eos = early_eos(target, ids, mask)

    def run(static):
        tgt = HFTarget(target, static=static)
        dr = drafter_of(good_drafter, tree, static=static)
        spies = ShapeSpy(tgt.runner), ShapeSpy(dr.runner)
        out = mmspec.speculative_generate(tgt, dr, ids, mask, temperature=0, max_new_tokens=24, eos_token_id=eos,
                                          pad_token_id=0)
        assert out.stats.active_rows[-1] < 4  # rows finished during the request
        return [set(s.shapes) for s in spies]

    target_shapes, drafter_shapes = run(True)
    assert len(target_shapes) == 1  # every verify of the request: one shape
    assert len(drafter_shapes) == 2  # catch-up, and draft step (chain) / tree level
    # The planted change: the default (dynamic) path fails the same assertions.
    target_shapes, drafter_shapes = run(False)
    assert len(target_shapes) > 1 and len(drafter_shapes) > 2


def compiled_frames() -> int:
    return counters["stats"]["unique_graphs"]


def test_compile_traces_once_per_forward_kind(target, good_drafter):
    """`compile` with fullgraph=True (a graph break, e.g. a host sync, would raise): the target's
    verify is traced once for two requests of different prompt lengths (same capacity bucket),
    with rows ending at different steps; the drafter adds its two forward kinds."""
    ids, mask = left_padded(LENGTHS)
    eos = early_eos(target, ids, mask)
    torch._dynamo.reset()
    counters.clear()
    tgt = HFTarget(target, compile=EAGER)
    dr = ModelDrafter(good_drafter, 3, static=True)
    for cut in (0, 2):  # the second request's prompts are 2 tokens shorter
        i, m = ids[:, cut:], mask[:, cut:]
        out = mmspec.speculative_generate(tgt, dr, i, m, temperature=0, max_new_tokens=12, eos_token_id=eos,
                                          pad_token_id=0)
        assert torch.equal(out.sequences, reference(target, i, m, 12, eos))
    assert out.stats.active_rows[0] == 4 and out.stats.target_calls > 3
    # One trace for every verify of both requests. (A compiled forward over the default store,
    # `static=False`, is refused; forced, it retraces as the key length grows: the shapes test
    # above shows its verify shapes change from step to step.)
    assert compiled_frames() == 1
    assert not counters["recompiles"]
    dr_c = ModelDrafter(good_drafter, 3, compile=EAGER)
    out = mmspec.speculative_generate(tgt, dr_c, ids, mask, temperature=0, max_new_tokens=12, eos_token_id=eos,
                                      pad_token_id=0)
    assert torch.equal(out.sequences, reference(target, ids, mask, 12, eos))
    assert compiled_frames() == 3  # + the drafter's catch-up and draft step


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
def test_compile_aot_eager_equals_eager(target, good_drafter, tree):
    ids, mask = left_padded(LENGTHS)
    kw = dict(temperature=0, max_new_tokens=10, pad_token_id=0)
    plain = mmspec.speculative_generate(target, drafter_of(good_drafter, tree), ids, mask, **kw)
    torch._dynamo.reset()
    counters.clear()
    tgt = HFTarget(target, compile={"backend": "aot_eager"})
    out = mmspec.speculative_generate(tgt, drafter_of(good_drafter, tree, static=True), ids, mask, **kw)
    assert torch.equal(out.sequences, plain.sequences)
    assert compiled_frames() == 1  # the verify did run compiled


# ---- refused options ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "compile,error,match",
    [
        ("fast", ValueError, "compile='fast'"),
        ({"dynamic": True}, ValueError, "dynamic"),
        ({"backend": "eager", "bogus": 1}, ValueError, "bogus"),
        ({"mode": "turbo"}, ValueError, "turbo"),
        (3, TypeError, "compile must be"),
    ],
)
def test_bad_compile_options_refused(target, compile, error, match):
    with pytest.raises(error, match=match):
        HFTarget(target, compile=compile)


def test_conflicting_options_refused(target, good_drafter):
    with pytest.raises(ValueError, match="drop static=False"):
        HFTarget(target, static=False, compile=True)
    with pytest.raises(ValueError, match="prepack=True"):
        HFTarget(target, prepack=True, compile=EAGER)
    with pytest.raises(TypeError, match="static must be a bool"):
        HFTarget(target, static="yes")
    with pytest.raises(ValueError, match="num_draft_tokens='auto'"):
        ModelDrafter(good_drafter, static=True)
    with pytest.raises(ValueError, match="num_draft_tokens='auto'"):
        ModelDrafter(good_drafter, compile=EAGER)


def test_compile_refused_for_unverified_model_type():
    from transformers import Qwen2VLForConditionalGeneration

    from conftest import tiny_qwen2vl_config

    model = Qwen2VLForConditionalGeneration(tiny_qwen2vl_config()).eval()
    with pytest.raises(ValueError, match="compile=.*Qwen2VLSpec"):
        HFTarget(model, compile=EAGER)
    HFTarget(model, static=True)  # static shapes alone are fine


def test_unknown_bounds_and_features_refused(target):
    ids, mask = left_padded(LENGTHS)
    with pytest.raises(ValueError, match="max_draft_nodes"):
        HFTarget(target, static=True).prefill(ids, mask, {}, 8, None)
    with pytest.raises(ValueError, match="max_slots"):
        StaticKV(2, mask, None)
    with pytest.raises(ValueError, match="features"):
        HFTarget(target, compile=EAGER).prefill(ids, mask, {}, 8, 3, mmspec.FeatureRequest(last_hidden=True))
