"""LlamaGen c2i GPT through its forward spec: speculative greedy decoding equals the plain
sampler's greedy tokens (float64, batch of 4 mixed classes), with and without CFG (constant
and linear schedules), chains and trees; the named rules get their tables from the target."""

from __future__ import annotations

import pytest
import torch

import mmspec
from mmspec.drafters import ModelDrafter
from mmspec.models.llamagen_spec import LlamaGenSpec, LlamaGenTarget, llamagen_target

from _llamagen_helpers import LABELS, NUM_CLASSES, noisy_gpt, plain_greedy, tiny_gpt

T = 16
TREE = mmspec.TreeConfig(depth=3, top_k=2, num_nodes=6)


def spec_generate(target, drafter, labels=LABELS, **kw):
    ids = labels.view(-1, 1)
    out = mmspec.speculative_generate(target, drafter, ids, temperature=0, max_new_tokens=T, **kw)
    return out.sequences[:, 1:], out.stats


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("cfg", [(1.0, "constant"), (3.0, "constant"), (4.0, "linear")], ids=["nocfg", "cfg", "linear"])
@pytest.mark.parametrize("which", ["self", "noisy"])
def test_speculative_greedy_equals_plain_sampler(tree, cfg, which):
    target_gpt = tiny_gpt(0)
    scale, schedule = cfg
    ref = plain_greedy(target_gpt, scale=scale, schedule=schedule)
    if scale != 1.0:  # guidance changes the tokens, so the comparison can fail
        assert not torch.equal(ref, plain_greedy(target_gpt))
    if schedule == "linear":
        assert not torch.equal(ref, plain_greedy(target_gpt, scale=scale))
    drafter_gpt = target_gpt if which == "self" else noisy_gpt(target_gpt, 0.3)
    target = llamagen_target(target_gpt, scale, cfg_schedule=schedule, num_tokens=T)
    tokens, stats = spec_generate(target, (ModelDrafter(LlamaGenSpec(drafter_gpt), tree=tree) if tree else ModelDrafter(LlamaGenSpec(drafter_gpt), 3)))
    assert torch.equal(tokens, ref)
    assert len({tuple(r) for r in ref.tolist()}) == 4  # classes give different images
    if which == "self" and scale == 1.0:
        assert stats.mean_accepted_drafts > 2.0  # the drafter is the target: (nearly) everything accepted
    assert stats.accepted_drafts > 0


def test_gqa_target_and_positions_past_the_end():
    """GQA GPT; block 9 with 4 draft tokens: drafts run past the last image token."""
    gpt = tiny_gpt(2, heads=4, kv_heads=2, block=9)
    ref = plain_greedy(gpt, n=9)
    ids = LABELS.view(-1, 1)
    out = mmspec.speculative_generate(LlamaGenTarget(gpt), ModelDrafter(LlamaGenSpec(gpt), 4), ids, temperature=0,
                                      max_new_tokens=9)
    assert torch.equal(out.sequences[:, 1:], ref)


def test_bad_requests_are_refused():
    gpt = tiny_gpt(0)
    target = LlamaGenTarget(gpt)
    drafter = ModelDrafter(LlamaGenSpec(gpt), 2)
    with pytest.raises(ValueError, match="unknown class id"):
        mmspec.speculative_generate(target, drafter, torch.tensor([[NUM_CLASSES + 1]]), temperature=0, max_new_tokens=3)
    with pytest.raises(ValueError, match=r"\[B, 1\] class ids"):
        mmspec.speculative_generate(target, drafter, torch.tensor([[1, 2]]), temperature=0, max_new_tokens=3)
    with pytest.raises(ValueError, match="no unconditional branch"):
        llamagen_target(tiny_gpt(0, null_class=False), 3.0)
    with pytest.raises(ValueError, match="cfg_schedule"):
        llamagen_target(gpt, 3.0, cfg_schedule="cosine")
    with pytest.raises(ValueError, match="codebook"):
        llamagen_target(gpt, 1.0, codebook=torch.zeros(5, 4))
    # More tokens than the image grid (block_size 16): tokens 17.. were computed at a clamped
    # position and returned (the plain sampler refuses the same request); guided or not.
    for t in (target, llamagen_target(gpt, 3.0)):
        with pytest.raises(ValueError, match="max_new_tokens=17 is more than the 16 tokens.*lower max_new_tokens to 16"):
            mmspec.speculative_generate(t, drafter, torch.tensor([[1]]), temperature=0, max_new_tokens=17)
    for n in (0, 17, 2.5):
        with pytest.raises(ValueError, match="num_tokens=.*block_size=16"):
            llamagen_target(gpt, 3.0, cfg_schedule="linear", num_tokens=n)


def test_linear_schedule_stays_at_its_scale_past_num_tokens():
    from mmspec.models.llamagen_sample import cfg_scale_at
    from mmspec.models.llamagen_spec import cfg_schedule_fn

    schedule = cfg_schedule_fn("linear", 4.0, 8)
    got = schedule(torch.arange(16)).tolist()
    assert got[:8] == [cfg_scale_at("linear", 4.0, i, 8) for i in range(8)]  # the plain sampler's arithmetic
    assert got[8:] == [4.0] * 8  # was 1 + 3 * i / 7, up to 7.43 at token 15


@pytest.mark.parametrize("scale", [1.0, 2.0])
def test_named_rules_get_tables_from_the_target(scale):
    gpt = tiny_gpt(0)
    codebook = torch.randn(gpt.args.vocab_size, 8, generator=torch.Generator().manual_seed(0))
    target = llamagen_target(gpt, scale, codebook=codebook)
    drafter = ModelDrafter(LlamaGenSpec(noisy_gpt(gpt, 0.3)), 3)
    for rule, kw in (("lantern", {"k": 8}), ("gsd", None)):
        out = mmspec.speculative_generate(target, drafter, LABELS.view(-1, 1), acceptance=rule, acceptance_kwargs=kw,
                                          max_new_tokens=T, generator=torch.Generator().manual_seed(1))
        assert out.sequences.shape == (4, T + 1) and not out.stats.lossless
    with pytest.raises(ValueError, match="codebook"):  # no VQ codebook given: LANTERN cannot run
        mmspec.speculative_generate(llamagen_target(gpt, scale), drafter, LABELS.view(-1, 1), acceptance="lantern",
                                    acceptance_kwargs={"k": 8}, max_new_tokens=T)


def test_a_compiled_runner_never_runs_prepacked_weights_or_eager_attention_choices(monkeypatch):
    """compile over a LlamaGenSpec ran its prepacked view ("auto" packs large row counts on some
    CPUs; per-call checks broke the graph) and, with the spec shared by an eager drafter, the CPU
    attention measurement of the runner built last. "auto" now compiles the model itself,
    prepack=True is refused, and each runner sets its own attention flag before its forwards."""
    import mmspec
    from mmspec.drafters import ModelDrafter
    from mmspec.models import kernel_choice
    from mmspec.models.llamagen_spec import LlamaGenSpec
    from mmspec.spec_target import SpecTarget

    from _llamagen_helpers import LABELS, plain_greedy, tiny_gpt

    gpt = tiny_gpt(0, dtype=torch.float32)
    mixed = kernel_choice.KernelPolicy(kernel_choice.ROWS, (False, True, True, True, True))
    monkeypatch.setattr(kernel_choice, "measure", lambda model, *a, **k: {"prepack": True, "policy": mixed})
    spec = LlamaGenSpec(gpt)
    assert spec.gpt is not gpt and spec.kernels.startswith("mixed by rows")
    SpecTarget(spec, compile={"backend": "aot_eager"})  # built, not run (tracing is slow)
    assert spec.gpt is gpt and spec.kernels == "stock"
    with pytest.raises(ValueError, match=r"LlamaGenSpec\(gpt, prepack=True\) cannot be compiled"):
        SpecTarget(LlamaGenSpec(gpt, prepack=True), compile={"backend": "aot_eager"})
    seen = []
    forward = LlamaGenSpec.forward

    def spy(self, tokens, attention, kv, *args, **kwargs):
        seen.append((type(kv).__name__, self.cpu_attention))
        return forward(self, tokens, attention, kv, *args, **kwargs)

    monkeypatch.setattr(LlamaGenSpec, "forward", spy)
    shared = LlamaGenSpec(gpt, prepack=False)
    target, drafter = SpecTarget(shared, static=True), ModelDrafter(shared, 3)  # the eager drafter built last
    out = mmspec.speculative_generate(target, drafter, LABELS.view(-1, 1), temperature=0, max_new_tokens=16)
    assert torch.equal(out.sequences[:, 1:], plain_greedy(gpt))
    assert {flag for kind, flag in seen if kind == "StaticKV"} == {False}  # the static target's forwards
    assert {flag for kind, flag in seen if kind == "RaggedKV"} == {True}  # the eager drafter's
