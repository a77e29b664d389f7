"""LlamaGen c2i GPT: official layout, an independent reference forward, incremental decoding
through the `kv` callable, GQA, CFG sampling, save / load.

The reference forward below is written from the official math (github.com/FoundationVision/
LlamaGen, autoregressive/models/gpt.py) with other code paths than mmspec's: a complex RoPE
table from `torch.polar` built by per-cell loops (mmspec stores cos / sin pairs), explicit
softmax attention, q and k rotated separately (mmspec rotates them in one call)."""

from __future__ import annotations

import math

import pytest
import torch

from mmspec.models.llamagen_gpt import (LlamaGenGPT, LlamaGenGPTConfig, preset_config)
from mmspec.models.llamagen_sample import SimpleKVCache, cfg_scale_at, generate_plain


def tiny_config(**kw) -> LlamaGenGPTConfig:
    base = dict(dim=32, n_layer=2, n_head=4, n_kv_head=None, multiple_of=16, vocab_size=24, num_classes=5,
                block_size=16, class_dropout_prob=0.1)
    base.update(kw)
    return LlamaGenGPTConfig(**base)


def tiny_model(seed: int = 0, dtype=torch.float64, **kw) -> LlamaGenGPT:
    torch.manual_seed(seed)
    model = LlamaGenGPT.from_args(tiny_config(**kw))
    with torch.no_grad():  # the official init zeroes the output layer; randomise everything
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return model.to(dtype).eval()


def official_c2i_b_state_dict(generator: torch.Generator, dtype=torch.float16) -> dict[str, torch.Tensor]:
    """Random weights under the official module names and shapes of c2i_B_256 (GPT-B, VQ-16
    codebook 16384, 1000 classes + the CFG null class), written from the official naming."""
    dim, n_layer, vocab, ffn = 768, 12, 16384, 2048  # ffn: find_multiple(int(2 * 4 * 768 / 3), 256)
    shapes = {"cls_embedding.embedding_table.weight": (1001, dim), "tok_embeddings.weight": (vocab, dim),
              "norm.weight": (dim,), "output.weight": (vocab, dim)}
    for i in range(n_layer):
        shapes.update({f"layers.{i}.attention.wqkv.weight": (3 * dim, dim), f"layers.{i}.attention.wo.weight": (dim, dim),
                       f"layers.{i}.feed_forward.w1.weight": (ffn, dim), f"layers.{i}.feed_forward.w3.weight": (ffn, dim),
                       f"layers.{i}.feed_forward.w2.weight": (dim, ffn), f"layers.{i}.attention_norm.weight": (dim,),
                       f"layers.{i}.ffn_norm.weight": (dim,)})
    out = {}
    for k, shape in shapes.items():
        t = torch.randn(shape, generator=generator) * (0.2 if len(shape) == 1 else 0.02)
        out[k] = (t + (1.0 if len(shape) == 1 else 0.0)).to(dtype)
    return out


# ---------------------------------------------------------------------- reference forward
# The rotary table is float32 (as the official); vectorised and scalar float32 cos / sin may
# differ by one ulp (6e-8), which moves float64 logits of these tiny models by ~1e-6. A wrong
# rotation, head grouping or norm moves them by O(1).
TABLE_ATOL = 1e-5
def ref_freqs(grid: int, head_dim: int, base: float, n_cls: int) -> torch.Tensor:
    """[n_cls + grid**2, head_dim // 2] complex: zeros for class rows; cell (r, c) rotates the
    first head_dim // 4 pairs by r * w_j and the others by c * w_j, w_j = base^(-2j / (head_dim/2))."""
    half = head_dim // 2
    w = [1.0 / (base ** (torch.tensor(2.0 * j, dtype=torch.float32) / half)) for j in range(half // 2)]
    rows = [torch.zeros(half, dtype=torch.complex128) for _ in range(n_cls)]
    for r in range(grid):
        for c in range(grid):
            ang = torch.stack([torch.tensor(float(r), dtype=torch.float32) * x for x in w]
                              + [torch.tensor(float(c), dtype=torch.float32) * x for x in w])
            # the official table is float32 (angles, cos and sin), then used by a float64 model
            rows.append(torch.polar(torch.ones(half, dtype=torch.float32), ang).to(torch.complex128))
    return torch.stack(rows)


def ref_forward(sd: dict, cfg: LlamaGenGPTConfig, labels: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Float64 logits [B, 1 + T, V] of the class token and image tokens idx [B, T]."""
    sd = {k: v.double() for k, v in sd.items()}
    nh, nkv, hd = cfg.n_head, cfg.kv_heads, cfg.dim // cfg.n_head
    x = torch.cat([sd["cls_embedding.embedding_table.weight"][labels][:, None], sd["tok_embeddings.weight"][idx]], 1)
    b, n, _ = x.shape
    fr = ref_freqs(math.isqrt(cfg.block_size), hd, cfg.rope_base, 1)[:n]

    def rms(t, w):
        return t / torch.sqrt((t * t).mean(-1, keepdim=True) + cfg.norm_eps) * w

    def rope(t):  # t [b, n, h, hd]; adjacent channels form the complex pairs
        c = torch.view_as_complex(t.reshape(*t.shape[:-1], hd // 2, 2).contiguous())
        return torch.view_as_real(c * fr[None, :, None, :]).reshape(t.shape)

    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for i in range(cfg.n_layer):
        p = f"layers.{i}."
        h = rms(x, sd[p + "attention_norm.weight"])
        qkv = h @ sd[p + "attention.wqkv.weight"].T
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], -1)
        q, k = rope(q.view(b, n, nh, hd)), rope(k.view(b, n, nkv, hd))
        v = v.view(b, n, nkv, hd)
        heads = []
        for hh in range(nh):
            kvh = hh // (nh // nkv)
            s = torch.einsum("bqd,bkd->bqk", q[:, :, hh], k[:, :, kvh]) / math.sqrt(hd)
            s = s.masked_fill(~causal, float("-inf")).softmax(-1)
            heads.append(torch.einsum("bqk,bkd->bqd", s, v[:, :, kvh]))
        x = x + torch.cat(heads, -1) @ sd[p + "attention.wo.weight"].T
        h = rms(x, sd[p + "ffn_norm.weight"])
        a, g = h @ sd[p + "feed_forward.w1.weight"].T, h @ sd[p + "feed_forward.w3.weight"].T
        x = x + (a * torch.sigmoid(a) * g) @ sd[p + "feed_forward.w2.weight"].T
    return rms(x, sd["norm.weight"]) @ sd["output.weight"].T


# ---------------------------------------------------------------------- official layout
def test_official_c2i_b_state_dict_loads_strictly_and_matches_reference(tmp_path):
    g = torch.Generator().manual_seed(0)
    sd = official_c2i_b_state_dict(g)
    path = tmp_path / "c2i_B_256.pt"
    torch.save({"model": sd, "optimizer": {}, "steps": 1}, path)
    model = LlamaGenGPT.from_official(path, "c2i_B_256")
    assert set(model.state_dict()) == set(sd)
    assert model.args.block_size == 256 and model.args.vocab_size == 16384 and model.args.num_classes == 1000
    labels, idx = torch.tensor([3, 1000]), torch.randint(0, 16384, (2, 6), generator=g)
    with torch.no_grad():
        ours, _ = model(idx, labels)
    ref = ref_forward(sd, model.args, labels, idx)
    assert ours.shape == (2, 7, 16384)
    torch.testing.assert_close(ours.double(), ref, rtol=0, atol=2e-3 * ref.abs().max().item())
    # the logits are not trivially equal: a different class changes them
    assert (ref_forward(sd, model.args, torch.tensor([4, 1000]), idx)[0] - ref[0]).abs().max() > 1e-2


@pytest.mark.parametrize("wrapper", ["model", "module", "ema", "state_dict", None])
def test_official_wrappers_and_float64_exact_reference(tmp_path, wrapper):
    model = tiny_model(seed=1)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    path = tmp_path / "ckpt.pt"
    torch.save(sd if wrapper is None else {wrapper: sd}, path)
    loaded = LlamaGenGPT.from_official(path, model.args).double()
    labels, idx = torch.tensor([0, 4, 5]), torch.randint(0, 24, (3, 15), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, _ = loaded(idx, labels)
    torch.testing.assert_close(ours, ref_forward(sd, model.args, labels, idx), rtol=0, atol=TABLE_ATOL)


def test_missing_unexpected_and_misshaped_keys_are_named(tmp_path):
    sd = tiny_model().state_dict()
    bad = dict(sd)
    del bad["layers.1.ffn_norm.weight"]
    bad["layers.2.attention.wo.weight"] = torch.zeros(32, 32)
    torch.save({"model": bad}, tmp_path / "a.pt")
    with pytest.raises(ValueError, match=r"layers\.1\.ffn_norm\.weight.*layers\.2\.attention\.wo\.weight"):
        LlamaGenGPT.from_official(tmp_path / "a.pt", tiny_config())
    shaped = dict(sd, **{"output.weight": torch.zeros(25, 32)})
    with pytest.raises(ValueError, match=r"output\.weight: checkpoint \(25, 32\) vs model \(24, 32\)"):
        LlamaGenGPT.from_official(shaped, tiny_config())


def test_checkpoints_saved_by_the_training_scripts_load(tmp_path):
    """train_c2i.py / vq_train.py save {"model", "optimizer", "steps", "args": argparse.Namespace}
    (+ "ema"): a weights-only load refused the Namespace, and such a file was "not a torch
    checkpoint". Other Python objects stay refused, saying what to do. DDP / torch.compile key
    prefixes are stripped (they were refused)."""
    import argparse

    from mmspec.models.llamagen_tokenizer import LlamaGenVQ, VQConfig

    model = tiny_model(seed=2)
    args = argparse.Namespace(gpt_model="GPT-B", image_size=256, ema=True)
    torch.save({"model": model.state_dict(), "optimizer": {"state": {}}, "steps": 10, "args": args,
                "ema": tiny_model(seed=3).state_dict()}, tmp_path / "train.pt")
    loaded = LlamaGenGPT.from_official(tmp_path / "train.pt", model.args)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    vq = LlamaGenVQ(VQConfig(codebook_size=16, ch=32, ch_mult=(1, 2), z_channels=32, num_res_blocks=1, image_size=16))
    torch.save({"model": vq.state_dict(), "steps": 3, "args": args}, tmp_path / "vq.pt")
    again = LlamaGenVQ.from_pretrained(tmp_path / "vq.pt")
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), vq.state_dict().values()))
    for prefix in ("module.", "_orig_mod.", "module._orig_mod."):  # DDP / torch.compile wrappers, stripped
        torch.save({"model": {prefix + k: v for k, v in model.state_dict().items()}}, tmp_path / "wrapped.pt")
        wrapped = LlamaGenGPT.from_official(tmp_path / "wrapped.pt", model.args)
        assert all(torch.equal(a, b) for a, b in zip(wrapped.state_dict().values(), model.state_dict().values()))
    torch.save({"module." + k: v for k, v in vq.state_dict().items()}, tmp_path / "vq_ddp.pt")
    assert torch.equal(LlamaGenVQ.from_pretrained(tmp_path / "vq_ddp.pt").quantize.embedding.weight,
                       vq.quantize.embedding.weight)
    torch.save({"model": model.state_dict(), "when": __import__("datetime").date(2024, 6, 1)}, tmp_path / "odd.pt")
    with pytest.raises(ValueError, match="Python objects besides tensors.*weights_only=False"):
        LlamaGenGPT.from_official(tmp_path / "odd.pt", model.args)


def test_other_architecture_is_refused(tmp_path):
    from mmspec.models.llamagen_tokenizer import LlamaGenVQ, VQConfig

    vq = LlamaGenVQ(VQConfig(codebook_size=16, ch=32, ch_mult=(1, 2), z_channels=32, num_res_blocks=1, image_size=16))
    torch.save({"model": vq.state_dict()}, tmp_path / "vq.pt")
    with pytest.raises(ValueError, match="not a LlamaGen c2i GPT checkpoint"):
        LlamaGenGPT.from_official(tmp_path / "vq.pt", "c2i_B_256")
    with pytest.raises(ValueError, match="model_type='t2i'"):
        preset_config("GPT-B", model_type="t2i")
    with pytest.raises(ValueError, match="unknown LlamaGen preset"):
        preset_config("c2i_Z_256")


def test_presets_have_official_sizes():
    sizes = {"c2i_B_256": (768, 12, 12, 256), "c2i_B_384": (768, 12, 12, 576), "c2i_L_256": (1024, 24, 16, 256),
             "c2i_L_384": (1024, 24, 16, 576), "c2i_XL_384": (1280, 36, 20, 576), "c2i_X_384": (1280, 36, 20, 576),
             "c2i_XXL_384": (1536, 48, 24, 576), "c2i_3B_384": (3200, 24, 32, 576)}  # the official README's table
    for name, (dim, layers, heads, block) in sizes.items():
        c = preset_config(name)
        assert (c.dim, c.n_layer, c.n_head, c.block_size, c.vocab_size) == (dim, layers, heads, block, 16384)
    assert preset_config("c2i_3B_384").ffn_dim == 8704 and preset_config("GPT-XXXL").head_dim == 64
    with pytest.raises(ValueError, match="multiple of 4"):
        LlamaGenGPTConfig(dim=24, n_head=4, block_size=16)
    with pytest.raises(ValueError, match="square"):
        LlamaGenGPTConfig(dim=32, n_head=4, block_size=15)


# ---------------------------------------------------------------------- rotary table
def test_rotary_table_zero_class_rows_and_2d_grid():
    model = tiny_model()
    table = model.freqs_at(torch.arange(17)[None])[0]  # [17, 4, 2]
    assert torch.all(table[0] == 0)  # class position: cos = sin = 0, as the official table
    ref = ref_freqs(4, 8, 10000.0, 1)
    torch.testing.assert_close(table[..., 0].double(), ref.real, atol=1e-7, rtol=0)
    torch.testing.assert_close(table[..., 1].double(), ref.imag, atol=1e-7, rtol=0)
    # image token 5 is row 1, column 1; token 6 is row 1, column 2: they share the row half
    assert torch.equal(table[1 + 5, :2], table[1 + 6, :2]) and not torch.equal(table[1 + 5, 2:], table[1 + 6, 2:])


# ---------------------------------------------------------------------- incremental decoding
@pytest.mark.parametrize("n_kv_head", [None, 2, 1])
def test_kv_decoding_equals_full_forward(n_kv_head):
    model = tiny_model(seed=2, n_kv_head=n_kv_head)
    labels = torch.tensor([0, 3, 5, 1])
    idx = torch.randint(0, 24, (4, 15), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full, _ = model(idx, labels)
        cache = SimpleKVCache(2, 4, model.args.kv_heads, 16, model.args.head_dim, torch.float64, torch.device("cpu"))
        steps, start = [], 0
        # class token, then chunks of 1, 3, 5 and 6 tokens (a verify-like multi-token step)
        chunks = [model.class_embed(labels)] + [model.embed(idx[:, a:b]) for a, b in [(0, 1), (1, 4), (4, 9), (9, 15)]]
        for x in chunks:
            q = x.shape[1]
            pos = torch.arange(start, start + q).expand(4, q)
            mask = (torch.arange(start + q)[None, :] <= pos[0][:, None]).expand(4, q, -1)
            steps.append(model.head(model.backbone(x, model.freqs_at(pos), mask, kv=cache)))
            cache.advance(q)
            start += q
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-12, atol=1e-12)


def test_gqa_matches_reference():
    model = tiny_model(seed=3, n_kv_head=2, n_head=8, dim=64)
    assert model.layers[0].attention.wqkv.weight.shape == ((8 + 2 * 2) * 8, 64)
    labels, idx = torch.tensor([2, 5]), torch.randint(0, 24, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, _ = model(idx, labels)
    torch.testing.assert_close(ours, ref_forward(model.state_dict(), model.args, labels, idx), rtol=0, atol=TABLE_ATOL)


def test_interface_errors():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"out of range.*null"):
        model.class_embed(torch.tensor([6]))
    x = model.embed(torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="needs attn_mask"):
        model.backbone(x, model.freqs_at(torch.tensor([[1, 2]])), None, kv=lambda i, k, v: (k, v))
    no_null = tiny_model(class_dropout_prob=0.0)
    assert no_null.cls_embedding.embedding_table.weight.shape[0] == 5
    with pytest.raises(ValueError, match="no unconditional"):
        generate_plain(no_null, torch.tensor([1]), 4, cfg_scale=2.0)
    with pytest.raises(ValueError, match="top_k=30 exceeds"):
        generate_plain(model, torch.tensor([1]), 4, top_k=30)


# ---------------------------------------------------------------------- plain sampler
def greedy_by_full_forward(model, labels, n, scale):
    """Greedy CFG decoding that re-runs the full teacher-forced forward for every token."""
    idx = torch.zeros(len(labels), 0, dtype=torch.long)
    for _ in range(n):
        c, _ = model(idx, labels)
        u, _ = model(idx, torch.full_like(labels, model.args.num_classes))
        idx = torch.cat([idx, (u[:, -1] + scale * (c[:, -1] - u[:, -1])).argmax(-1, keepdim=True)], 1)
    return idx


@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_generate_plain_greedy_matches_full_forward(scale):
    model = tiny_model(seed=4)
    labels = torch.tensor([0, 2, 4, 1])
    with torch.no_grad():
        want = greedy_by_full_forward(model, labels, 16, scale)
    got = generate_plain(model, labels, 16, cfg_scale=scale, temperature=0.0)
    assert torch.equal(got, want)
    if scale != 1.0:  # guidance changes the output (the test could fail)
        assert not torch.equal(got, generate_plain(model, labels, 16, cfg_scale=1.0, temperature=0.0))


def test_generate_plain_sampling_is_seeded_and_schedules():
    model = tiny_model(seed=5)
    labels = torch.tensor([1, 3])
    a = generate_plain(model, labels, 16, cfg_scale=2.0, generator=torch.Generator().manual_seed(0))
    b = generate_plain(model, labels, 16, cfg_scale=2.0, generator=torch.Generator().manual_seed(0))
    c = generate_plain(model, labels, 16, cfg_scale=2.0, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and not torch.equal(a, c) and int(a.min()) >= 0 and int(a.max()) < 24
    assert cfg_scale_at("linear", 4.0, 0, 16) == 1.0 and cfg_scale_at("linear", 4.0, 15, 16) == 4.0
    assert cfg_scale_at("constant", 4.0, 0, 16) == 4.0
    with pytest.raises(ValueError, match="cfg_schedule"):
        cfg_scale_at("cosine", 4.0, 0, 16)


def test_training_forward_loss_and_class_dropout():
    model = tiny_model(seed=6, dtype=torch.float32, class_dropout_prob=0.5)
    idx = torch.randint(0, 24, (64, 15))
    labels = torch.randint(0, 5, (64,))
    dropped = model.drop_labels(labels, torch.Generator().manual_seed(0))
    frac = (dropped == 5).float().mean().item()
    assert 0.5 - 4 * 0.0625 < frac < 0.5 + 4 * 0.0625  # binomial(64, 0.5): 4 sigma
    assert torch.equal(dropped[dropped != 5], labels[dropped != 5])
    targets = torch.cat([idx, torch.randint(0, 24, (64, 1))], 1)
    model.eval()
    logits, loss = model(idx, labels, targets=targets)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 24), targets.reshape(-1))
    torch.testing.assert_close(loss, ref)
    model.train()
    _, loss = model(idx, labels, targets=targets)
    loss.backward()
    assert model.output.weight.grad is not None and torch.isfinite(model.output.weight.grad).all()


def test_diffusers_save_load_fp16_roundtrip(tmp_path):
    model = tiny_model(seed=7, dtype=torch.float16)
    model.save_pretrained(tmp_path / "gpt")
    assert (tmp_path / "gpt" / "diffusion_pytorch_model.safetensors").is_file()
    loaded = LlamaGenGPT.from_pretrained(tmp_path / "gpt", torch_dtype=torch.float16)
    assert loaded.args == model.args
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    labels = torch.tensor([1, 2])
    a = generate_plain(model.float(), labels, 8, cfg_scale=2.0, generator=torch.Generator().manual_seed(0))
    b = generate_plain(loaded.float(), labels, 8, cfg_scale=2.0, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a, b)


def test_a_checkpoints_own_training_args_must_agree_with_the_config(tmp_path):
    """The grid is not in the weights: a file whose saved `args` say 384 px (24x24 tokens) loaded
    under a 256-px preset without a word, and generated the wrong grid."""
    import argparse

    model = tiny_model(seed=2)  # block_size 16: a 4x4 grid
    ok = argparse.Namespace(gpt_model="GPT-B", image_size=64, downsample_size=16, vocab_size=24, num_classes=5,
                            cls_token_num=1, gpt_type="c2i")
    torch.save({"model": model.state_dict(), "args": ok}, tmp_path / "ok.pt")
    loaded = LlamaGenGPT.from_official(tmp_path / "ok.pt", model.args)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    for change, message in [(dict(image_size=128), r"image_size 128 / downsample_size 16 -> 64 image tokens, the "
                                                   r"config's block_size 16"),
                            (dict(vocab_size=16384), r"vocab_size 16384, the config's vocab_size 24"),
                            (dict(num_classes=1000), r"num_classes 1000, the config's num_classes 5")]:
        torch.save({"model": model.state_dict(), "args": argparse.Namespace(**{**vars(ok), **change})},
                   tmp_path / "bad.pt")
        with pytest.raises(ValueError, match="training args disagree with the config: " + message):
            LlamaGenGPT.from_official(tmp_path / "bad.pt", model.args)
    # a released-size file: the refusal names the preset that fits (checked before the weights)
    big = argparse.Namespace(gpt_model="GPT-B", image_size=384, downsample_size=16)
    with pytest.raises(ValueError, match=r"576 image tokens, the config's block_size 256; use preset 'c2i_B_384'"):
        LlamaGenGPT.from_official({"model": model.state_dict(), "args": big}, "c2i_B_256")
    odd = argparse.Namespace(gpt_model="GPT-L", image_size=256, downsample_size=8)
    with pytest.raises(ValueError, match=r"use preset_config\('GPT-L', block_size=1024\)$"):
        LlamaGenGPT.from_official({"model": model.state_dict(), "args": odd}, "c2i_L_256")


def test_training_args_hints_name_only_what_fits_and_errors_name_the_file(tmp_path):
    import argparse

    import numpy as np

    model = tiny_model(seed=2)
    state = model.state_dict()
    for args, message in [
        (dict(gpt_model="GPT-B", image_size=256, downsample_size=16, vocab_size=8192),
         r"vocab_size 8192, the config's vocab_size 16384; use preset_config\('GPT-B', block_size=256, "
         r"vocab_size=8192\)"),
        (dict(gpt_model="GPT-XL", image_size=256, downsample_size=16, gpt_type="t2i"),
         r"gpt_type 't2i' is not supported"),
        (dict(gpt_model="GPT-B", image_size=np.int64(384), downsample_size=np.int64(16)),  # NumPy ints too
         r"576 image tokens, the config's block_size 256; use preset 'c2i_B_384'"),
    ]:
        with pytest.raises(ValueError, match=message):
            LlamaGenGPT.from_official({"model": state, "args": argparse.Namespace(**args)}, "c2i_B_256")
    torch.save({"model": state}, tmp_path / "mine.pt")  # a key mismatch names the file again
    with pytest.raises(ValueError, match="mine.pt"):
        LlamaGenGPT.from_official(tmp_path / "mine.pt", "c2i_B_256")
