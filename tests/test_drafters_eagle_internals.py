"""EAGLE-2 / ViSpec heads' inner pieces, each against a direct computation: the RoPE table, the
inference layer against the module's forward (following weight updates), the embedding and LM
head called as functions (hooks respected), and ViSpec's batched prompt compression against
its row-by-row loop (split from tests/test_drafters_eagle.py)."""

from __future__ import annotations

import pytest
import torch

from mmspec.drafters import EagleHeadConfig, ViSpecHead


def test_rope_table_equals_direct_angles():
    """The CPU RoPE table (grown past its first 256 positions, per dtype) gives the same cos /
    sin as computing the angles directly in float64."""
    from mmspec.drafters.eagle_head import HeadAttention

    att = HeadAttention(EagleHeadConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                        num_key_value_heads=4, vocab_size=10))
    for dtype, positions in ((torch.float64, torch.tensor([[0, 5, 255]])), (torch.float64, torch.tensor([[3, 700, 1]])),
                             (torch.float32, torch.tensor([[9, 1000]]))):
        freqs = positions.unsqueeze(-1).double() * att.inv_freq
        emb = torch.cat([freqs, freqs], -1).unsqueeze(1)
        # without a bound (read from the positions) and with a caller's host bound (drafting
        # steps), which may lie past the table's end and must grow it
        for bound in (None, int(positions.max()), 3 * int(positions.max()) + 7):
            cos, sin = att._rope(positions, dtype, bound)
            assert cos.dtype == dtype and torch.equal(cos, emb.cos().to(dtype)) and torch.equal(sin, emb.sin().to(dtype))
    assert att._rope_table[0].shape[0] >= 3 * 1000 + 8
    with pytest.raises(ValueError, match="RoPE positions must be >= 0"):
        att._rope(torch.tensor([[3, -1]]), torch.float64)


def test_inference_layer_equals_module_forward_and_follows_weight_updates():
    """`HeadLayer` (stacked q/k/v and gate/up weights, kept between no-grad calls) computes a
    Llama decoder layer without input norm, written here from its separate submodules (float64,
    GQA, a mask and a KV cache), with autograd on and off; an in-place weight update (an
    optimiser step between calls) reaches the no-grad path."""
    import torch.nn.functional as F

    from mmspec.drafters.eagle_head import HeadLayer, rotate_half
    from mmspec.ragged import RaggedKV

    torch.manual_seed(0)
    cfg = EagleHeadConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                          vocab_size=10)
    layer = HeadLayer(cfg).double()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2, 3, 4], [0, 0, 1, 2, 3]])
    visible = torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 5, 5).clone()
    visible[1, :, 0] = False
    visible[1, 0, 0] = True

    def reference():
        a, m = layer.self_attn, layer.mlp
        q = a.q_proj(x).view(2, 5, 4, 8).transpose(1, 2)
        k = a.k_proj(x).view(2, 5, 2, 8).transpose(1, 2)
        v = a.v_proj(x).view(2, 5, 2, 8).transpose(1, 2)
        cos, sin = a._rope(positions, x.dtype)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=visible.unsqueeze(1))
        y = x + a.o_proj(att.transpose(1, 2).reshape(2, 5, 32))
        n = layer.post_attention_layernorm
        hn = n.weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + n.eps))
        return (y + m["down_proj"](F.silu(m["gate_proj"](hn)) * m["up_proj"](hn))).detach()

    def both():
        outs = []
        for grad in (True, False):
            kv = RaggedKV(1, torch.ones(2, 5, dtype=torch.long), 16)
            attention = kv.plan_prefill(torch.ones(2, 5, dtype=torch.long))
            assert attention.is_prefill
            with torch.set_grad_enabled(grad):
                outs.append(layer(x, positions, visible, kv).detach())
        return outs

    ref = reference()
    for got in both():
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        layer.self_attn.k_proj.weight.mul_(2.0)
        layer.mlp["up_proj"].weight.add_(0.1)
    ref2 = reference()
    for got in both():
        torch.testing.assert_close(got, ref2, rtol=1e-12, atol=1e-12)
    assert (ref2 - ref).abs().max() > 1e-3  # the update changed the output, and the layer followed it


def test_embed_and_head_called_as_functions_equal_the_modules_and_respect_hooks():
    """`HFSpec.embed` / `head` call a plain nn.Embedding / nn.Linear as their functions: the
    same values as the modules, in-place weight updates seen; a module with a hook (or a
    subclass) is called as the module, so the hook runs."""
    from mmspec.models.hf_spec import _plain_call

    torch.manual_seed(0)
    emb, lin = torch.nn.Embedding(11, 6, padding_idx=0), torch.nn.Linear(6, 11)
    tokens, x = torch.tensor([[0, 3, 10]]), torch.randn(2, 3, 6)
    fe, fl = _plain_call(emb), _plain_call(lin)
    assert fe is not emb and fl is not lin
    assert torch.equal(fe(tokens), emb(tokens)) and torch.equal(fl(x), lin(x))
    with torch.no_grad():
        emb.weight.mul_(2.0)
        lin.bias.add_(1.0)
    assert torch.equal(fe(tokens), emb(tokens)) and torch.equal(fl(x), lin(x))
    seen = []
    lin.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    assert _plain_call(lin) is lin
    _plain_call(lin)(x)
    assert seen == [x.shape[:-1] + (11,)]

    class Scaled(torch.nn.Embedding):
        def forward(self, t):
            return super().forward(t) * 3

    scaled = Scaled(11, 6)
    assert _plain_call(scaled) is scaled


@pytest.mark.parametrize("grad", [False, True])
def test_vispec_batched_prompt_compression_equals_the_row_loop(grad):
    """One image span per row (the common batch) is compressed without a loop over rows; it
    must give the general loop's inputs, positions, mask, sources and global vectors, with
    left padding of different lengths, text before and after the span, and under autograd
    (training). Other batches (two spans in a row, spans of different lengths, no image) take
    the loop."""

    torch.manual_seed(0)
    cfg = EagleHeadConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2,
                          vocab_size=20, image_token_id=7, kind="vispec", num_q=3)
    head = ViSpecHead(cfg).double()
    with torch.no_grad():
        head.img_fc.weight.normal_()  # not the identity start: g must matter
    I = 7

    def batch(rows):
        L = max(len(r) for r in rows)
        toks = torch.tensor([[0] * (L - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (L - len(r)) + [1] * len(r) for r in rows])
        return toks, mask

    def run(toks, mask, loop):
        B, L = toks.shape
        g = torch.Generator().manual_seed(1)
        embeds = torch.randn(B, L, 16, generator=g, dtype=torch.float64, requires_grad=grad)
        hidden = torch.randn(B, L, 16, generator=g, dtype=torch.float64)
        if loop:
            head._prepare_one_span = lambda *a: None
        try:
            with torch.set_grad_enabled(grad):
                out = head.prepare(toks, embeds, hidden, mask)
        finally:
            head.__dict__.pop("_prepare_one_span", None)
        return out

    same_shape = [[3, 4, I, I, I, I, I, 5, 6, 2], [9, I, I, I, I, I, 8, 2], [1, 2, 3, I, I, I, I, I, 4]]
    toks, mask = batch(same_shape)
    seen = []
    original = ViSpecHead._prepare_one_span
    ViSpecHead._prepare_one_span = lambda self, *a: seen.append(1) or original(self, *a)
    try:
        fast = run(toks, mask, loop=False)
    finally:
        ViSpecHead._prepare_one_span = original
    slow = run(toks, mask, loop=True)
    assert seen and fast[0].shape == slow[0].shape
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    if grad:  # the adaptor and fuse weights receive the same gradients either way
        gf = torch.autograd.grad(fast[0].sum() + fast[4].sum(), list(head.parameters()), allow_unused=True)
        gs = torch.autograd.grad(slow[0].sum() + slow[4].sum(), list(head.parameters()), allow_unused=True)
        for a, b in zip(gf, gs):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # Batches the loop-free path must leave to the loop: it returns None for them.
    for rows in ([[I, I, I, 1, I, I, I, 2], [3, I, I, I, I, I, I, 4]],  # two spans in a row
                 [[I, I, I, I, 1, 2], [3, I, I, I, 4]],  # spans of different lengths
                 [[1, 2, 3], [4, 5]]):  # no image
        toks, mask = batch(rows)
        is_img = (toks == I) & mask.bool()
        is_img[:, -1] = False
        e = torch.zeros(*toks.shape, 16, dtype=torch.float64)
        assert head._prepare_one_span(e, e, mask, is_img, cfg.num_q - 1) is None
