"""The CPU attention choice (mmspec/cpu_attention.py, mmspec/models/hf_attention.py): the plain
form computes what torch's fused kernel computes (grouped-query heads, additive masks with fully
masked keys, strided inputs, half precision); a shape class is decided from paired timings and
keeps the faster form; ineligible inputs never take part; in transformers models it runs only
inside step forwards with attention="auto", leaves the model's configuration as it found it,
greedy speculative decoding through it equals the model's own greedy decoding, and exact
sampling through it is distributed like the target (a transformers model; the image GPT with CFG)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

import mmspec
from mmspec import cpu_attention as ca
from mmspec.drafters import ModelDrafter
from mmspec.models.hf_target import HFTarget

from conftest import left_padded, noisy_copy, tiny_llama


pytestmark = pytest.mark.cpu_attention  # the measured choice, not torch's form (tests/conftest.py)


@pytest.fixture(autouse=True)
def fresh_decisions():
    ca.reset()
    yield
    ca.reset()


def additive_mask(B, Q, S, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    vis = torch.rand(B, 1, Q, S, generator=g) < 0.7
    vis[..., -1] = True  # every query sees a key ...
    vis[0, 0, 0] = False  # ... but one: a fully masked query (uniform over keys, as in sdpa)
    return torch.zeros(B, 1, Q, S, dtype=dtype).masked_fill(~vis, torch.finfo(dtype).min)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_plain_form_matches_torch_sdpa(heads, kv_heads):
    g = torch.Generator().manual_seed(1)
    B, Q, S, D = 3, 5, 11, 8
    # queries strided as in transformers ([B, Q, H, D] transposed), keys a slice of a longer buffer
    q = torch.randn(B, Q, heads, D, generator=g, dtype=torch.float64).transpose(1, 2)
    buf = torch.randn(2, B, kv_heads, S + 4, D, generator=g, dtype=torch.float64)
    k, v = buf[0, :, :, :S], buf[1, :, :, :S]
    mask = additive_mask(B, Q, S, torch.float64)
    rep = heads // kv_heads
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                          attn_mask=mask, scale=0.3)
    got = ca.matmul_attention(q, k, v, mask, 0.3)
    assert got.shape == (B, heads, Q, D)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.allclose(got[0, :, 0], v[0].repeat_interleave(rep, 0).mean(1), atol=1e-12), "fully masked: uniform"
    # default scale 1/sqrt(D), no mask
    torch.testing.assert_close(ca.matmul_attention(q, k, v, None),
                               F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                                              v.repeat_interleave(rep, 1)), rtol=1e-12, atol=1e-12)


def test_plain_form_in_bfloat16_is_close_to_float32():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, 3, 16, generator=g) for _ in range(3))
    for half in (torch.bfloat16, torch.float16):
        mask = additive_mask(2, 3, 3, half)  # its own dtype's most negative value, as mmspec builds it
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.float())
        got = ca.matmul_attention(q.to(half), k.to(half) * 30, v.to(half), mask, scale=0.25 / 30)  # large scores
        assert got.dtype == half and torch.isfinite(got).all(), half
        torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        ca.matmul_attention(torch.zeros(1, 3, 1, 4), torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4), None)


def inputs(B=2, Q=3, S=7, dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, 2, n, 4, generator=g, dtype=dtype) for n in (Q, S, S))
    return q, k, v, additive_mask(B, Q, S, dtype)


def test_a_shape_class_keeps_the_faster_form(monkeypatch):
    q, k, v, mask = inputs()
    sentinel = torch.zeros(1)

    def slow_torch():
        time.sleep(0.003)
        return sentinel

    outs = [ca.attend(q, k, v, mask, None, slow_torch) for _ in range(ca.SAMPLES)]
    assert all(o is sentinel for o in outs), "while a class is measured, torch's result is returned"
    [choice] = ca.choices()
    assert choice["form"] == "matmul" and choice["matmul_over_sdpa"] < ca.MARGIN
    assert (choice["rows"], choice["queries"], choice["keys"], choice["heads"], choice["kv_heads"]) == (2, 4, 8, 2, 2)
    out = ca.attend(q, k, v, mask, None, slow_torch)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    assert "matmul in 1 of 1" in ca.describe()

    # Another class (more rows) where the plain form is the slow one keeps torch's.
    q2, k2, v2, mask2 = inputs(B=5)
    real = ca.matmul_attention

    def slow_plain(*a, **kw):
        time.sleep(0.003)
        return real(*a, **kw)

    monkeypatch.setattr(ca, "matmul_attention", slow_plain)
    for _ in range(ca.SAMPLES + 2):
        assert ca.attend(q2, k2, v2, mask2, None, lambda: sentinel) is sentinel
    forms = {c["rows"]: c["form"] for c in ca.choices()}
    assert forms == {2: "matmul", 8: "sdpa"}


def test_eligibility_and_forcing():
    q, k, v, mask = inputs()
    assert ca.eligible(q, mask)
    assert not ca.eligible(q, None), "one-token forwards without a mask stay on torch's path"
    assert not ca.eligible(q, mask > 0), "boolean masks are not taken"
    assert not ca.eligible(q, mask[:, :, None]), "only [B, 1, Q, S] masks"
    assert not ca.eligible(q.requires_grad_(), mask)
    q = q.detach()
    q64, k64, v64, mask64 = inputs(dtype=torch.float64)
    assert not ca.eligible(q64, mask64), "float64 keeps torch's path unless forced"
    assert ca.takes_part(q) and not ca.takes_part(q64), "the mask-free check callers run before building a mask"
    with ca.forced("matmul"):
        assert ca.eligible(q64, mask64) and ca.takes_part(q64)
        out = ca.attend(q64, k64, v64, mask64, None, lambda: pytest.fail("forced matmul ran torch's path"))
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q64, k64, v64, attn_mask=mask64))
        with ca.forced("sdpa"):
            assert ca.attend(q64, k64, v64, mask64, None, lambda: "torch") == "torch"
        assert ca._FORCED[0] == "matmul"
    assert ca._FORCED[0] is None and ca.choices() == []
    with pytest.raises(ValueError, match="form must be one of"):
        with ca.forced("flash"):
            pass


def counting_matmul(monkeypatch):
    calls = {"n": 0}
    real = ca.matmul_attention

    def counted(*a, **kw):
        calls["n"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(ca, "matmul_attention", counted)
    return calls


def test_hf_greedy_through_the_plain_form_equals_the_models_greedy(monkeypatch):
    target = tiny_llama(layers=2, seed=0)  # float64, grouped-query heads (4 over 2)
    drafter = noisy_copy(target, 0.3)
    ids, mask = left_padded([9, 4, 7, 6])
    want = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=0,
                           eos_token_id=None)
    calls = counting_matmul(monkeypatch)
    with ca.forced("matmul"):
        out = mmspec.speculative_generate(HFTarget(target), ModelDrafter(drafter, 3), ids, mask, temperature=0,
                                          max_new_tokens=12, pad_token_id=0)
    assert calls["n"] > 0, "the plain form ran"
    assert torch.equal(out.sequences, want)
    assert target.config._attn_implementation == "sdpa", "the model's configuration is restored"
    assert drafter.config._attn_implementation == "sdpa"


def test_hf_attention_torch_and_other_implementations_never_take_part(monkeypatch):
    target = tiny_llama(layers=2, seed=0)
    ids, mask = left_padded([9, 4, 7])
    calls = counting_matmul(monkeypatch)
    with ca.forced("matmul"):
        mmspec.speculative_generate(HFTarget(target, attention="torch"), ModelDrafter(noisy_copy(target, 0.3), 2,
                                                                                        attention="torch"),
                                    ids, mask, temperature=0, max_new_tokens=6, pad_token_id=0)
        assert calls["n"] == 0
        eager = tiny_llama(layers=2, seed=0)
        eager.config._attn_implementation = "eager"
        mmspec.speculative_generate(HFTarget(eager), ModelDrafter(noisy_copy(eager, 0.3), 2), ids, mask,
                                    temperature=0, max_new_tokens=6, pad_token_id=0)
        assert calls["n"] == 0, "a model on another attention implementation is left on it"
        assert eager.config._attn_implementation == "eager"


def test_hf_float32_batched_steps_are_measured_and_decided():
    target = tiny_llama(layers=2, seed=0, dtype=torch.float32)
    ids, mask = left_padded([9, 4, 7, 6, 5, 8, 3, 9])
    out = mmspec.speculative_generate(HFTarget(target), ModelDrafter(noisy_copy(target, 0.3), 3), ids, mask,
                                      temperature=0, max_new_tokens=16, pad_token_id=0)
    made = ca.choices()
    assert made, "the batched verify forwards were measured"
    assert {c["dtype"] for c in made} == {"float32"} and all(c["form"] in ca.FORMS for c in made)
    assert all(c["queries"] >= 1 and c["rows"] <= 8 for c in made)
    want = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=0,
                           eos_token_id=None)
    # float32: the two forms agree to rounding, so tokens may only differ after a near-tie
    assert (out.sequences == want).float().mean() > 0.9


@pytest.mark.parametrize("kv_heads", [None, 2], ids=["mha", "gqa"])
def test_llamagen_greedy_with_cfg_through_the_plain_form_equals_the_plain_sampler(monkeypatch, kv_heads):
    """mmspec's LlamaGen GPT: speculative greedy decoding with CFG (batch of 4 mixed classes,
    float64, a tree and a chain drafter) through the plain form equals the plain sampler's."""
    from mmspec.models.llamagen_spec import LlamaGenSpec, llamagen_target

    from _llamagen_helpers import LABELS, noisy_gpt, plain_greedy, tiny_gpt

    gpt = tiny_gpt(0, kv_heads=kv_heads)
    ref = plain_greedy(gpt, scale=3.0)
    calls = counting_matmul(monkeypatch)
    for drafter in (ModelDrafter(LlamaGenSpec(noisy_gpt(gpt, 0.3)), 3),
                    ModelDrafter(LlamaGenSpec(noisy_gpt(gpt, 0.3)), tree=mmspec.TreeConfig(depth=3, top_k=2,
                                                                                         num_nodes=6))):
        with ca.forced("matmul"):
            out = mmspec.speculative_generate(llamagen_target(gpt, 3.0, num_tokens=16), drafter, LABELS.view(-1, 1),
                                              temperature=0, max_new_tokens=16)
        assert torch.equal(out.sequences[:, 1:], ref)
    assert calls["n"] > 0, "the plain form ran"


def test_llamagen_float32_steps_are_measured_and_training_never_takes_part():
    from mmspec.models.llamagen_spec import LlamaGenSpec, llamagen_target

    from _llamagen_helpers import LABELS, noisy_gpt, tiny_gpt

    gpt = tiny_gpt(0, dtype=torch.float32)
    mmspec.speculative_generate(llamagen_target(gpt, 3.0, num_tokens=16),
                                ModelDrafter(LlamaGenSpec(noisy_gpt(gpt, 0.3)), 3), LABELS.view(-1, 1),
                                temperature=1.0, max_new_tokens=16, generator=torch.Generator().manual_seed(0))
    made = ca.choices()
    assert made and {c["rows"] for c in made} <= {1, 2, 4, 8}, "CFG doubles the 4 rows"
    # A layer takes the caller's `attend` in eval mode only; training runs torch's form.
    x = torch.randn(2, 5, gpt.args.dim)
    freqs = gpt.freqs_at(torch.arange(5).expand(2, 5))
    asked = []

    def attend(q, k, v, torch_path):
        asked.append(q.shape)
        return torch_path()

    gpt.backbone(x, freqs, attend=attend)
    assert len(asked) == gpt.args.n_layer
    gpt.train()
    gpt.backbone(x.requires_grad_(), freqs, attend=attend).sum().backward()
    assert len(asked) == gpt.args.n_layer, "train mode never asks for a form"


def test_hf_exact_sampling_through_the_plain_form_matches_the_enumerated_joint(monkeypatch):
    """Exact speculative sampling with every verify forward on the plain form is distributed
    like the target (chi-square against the enumerated joint of tokens 2 and 3, power checked
    against the drafter's joint). This tiny model's tokens hardly depend on attention (an
    unmasked verify moves the joint by ~2% total variation), so errors of the form itself are
    the greedy test's to catch (it fails on a dropped mask or a 10% scale error); the image
    GPT's test below also catches both."""
    from test_core_sampling import V, chi_square_p, joint_23

    target = tiny_llama(layers=2, seed=3, vocab=V, hidden=16)
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)
    drafter = noisy_copy(target, 0.6, seed=9)
    prompt = torch.tensor([[1, 5, 3, 6]])
    n = 12000
    calls = counting_matmul(monkeypatch)
    with ca.forced("matmul"):
        out = mmspec.speculative_generate(HFTarget(target), ModelDrafter(drafter, 3), prompt.expand(n, -1),
                                          temperature=1.0, max_new_tokens=3, generator=torch.Generator().manual_seed(11))
    assert calls["n"] > 0, "the plain form ran"
    assert 0 < out.stats.accepted_drafts < out.stats.drafted_nodes
    new = out.sequences[:, 4:]
    counts = torch.zeros(V, V)
    counts.index_put_((new[:, 1], new[:, 2]), torch.ones(n), accumulate=True)
    sampling = mmspec.SamplingConfig(1.0, None)
    assert chi_square_p(counts, joint_23(target, prompt, sampling), n) > 1e-4
    assert chi_square_p(counts, joint_23(drafter, prompt, sampling), n) < 1e-4  # power


def test_llamagen_exact_cfg_sampling_through_the_plain_form_matches_the_guided_joint(monkeypatch):
    """The image GPT's verify forwards on the plain form: exact sampling with CFG and coupled
    Jacobi drafts is distributed like guided plain sampling (power: the unguided joint fails)."""
    from mmspec.drafters import JacobiDrafter

    from test_core_sampling import chi_square_p
    from test_jacobi_drafter import SAMPLES, SCALE, V, cfg_gpt, guided_joint, sample_counts

    gpt = cfg_gpt()
    calls = counting_matmul(monkeypatch)
    with ca.forced("matmul"):
        counts, stats = sample_counts(gpt, JacobiDrafter(3, "maximal", vocab_size=V))
    assert calls["n"] > 0, "the plain form ran"
    assert 0 < stats.accepted_drafts < stats.drafted_nodes
    assert chi_square_p(counts, guided_joint(gpt, SCALE), SAMPLES) > 1e-4
    assert chi_square_p(counts, guided_joint(gpt, 1.0), SAMPLES) < 1e-6
