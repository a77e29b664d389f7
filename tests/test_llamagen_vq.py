"""LlamaGen VQ tokenizer: official checkpoint layout, our save/load, shapes, the bundled
testbed asset, config validation."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from mmspec.models.llamagen_tokenizer import LlamaGenVQ, VQConfig, infer_config

ASSET = Path(__file__).resolve().parents[1] / "assets" / "testbed" / "vq"
# Measured: 32.3 dB mean on validation scenes 0-7 (31.8 dB on 256 scenes, metrics.json);
# 3 dB margin for other CPUs / torch versions.
MIN_ASSET_PSNR = 29.0
# Key names read from FoundationVision/LlamaGen tokenizer/tokenizer_image/vq_model.py
# (last changed in 0b3a62b; checked at ce98ec4): VQModel / Encoder / Decoder / VectorQuantizer.
OFFICIAL_KEYS = [
    "encoder.conv_in.weight", "encoder.conv_blocks.0.res.0.norm1.weight", "encoder.conv_blocks.0.res.0.conv1.weight",
    "encoder.conv_blocks.0.res.0.norm2.bias", "encoder.conv_blocks.0.res.0.conv2.weight",
    "encoder.conv_blocks.1.res.0.nin_shortcut.weight", "encoder.conv_blocks.0.downsample.conv.weight",
    "encoder.conv_blocks.1.attn.0.q.weight", "encoder.conv_blocks.1.attn.0.proj_out.bias",
    "encoder.mid.0.conv1.weight", "encoder.mid.1.norm.weight", "encoder.mid.2.conv2.bias",
    "encoder.norm_out.weight", "encoder.conv_out.weight", "quant_conv.weight", "quantize.embedding.weight",
    "quantize.codebook_used", "post_quant_conv.weight", "decoder.conv_in.weight", "decoder.mid.1.k.weight",
    "decoder.conv_blocks.0.res.1.conv1.weight", "decoder.conv_blocks.0.attn.1.v.weight",
    "decoder.conv_blocks.0.upsample.conv.weight", "decoder.conv_blocks.1.res.0.nin_shortcut.weight",
    "decoder.norm_out.weight", "decoder.conv_out.weight",
]


def tiny_config(**kw) -> VQConfig:
    base = dict(codebook_size=16, codebook_embed_dim=4, ch=32, ch_mult=(1, 2), z_channels=32, num_res_blocks=1,
                image_size=16)
    return VQConfig(**{**base, **kw})


def tiny_model(seed: int = 0, **kw) -> LlamaGenVQ:
    torch.manual_seed(seed)
    model = LlamaGenVQ(tiny_config(**kw)).eval()
    with torch.no_grad():  # spread the codebook so that several codes are in use
        model.quantize.embedding.weight.normal_()
    return model


def pixels(b: int = 2, s: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.rand(b, 3, s, s, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def test_official_checkpoint_layout_loads_exactly(tmp_path):
    model = tiny_model()
    keys = set(model.state_dict())
    assert set(OFFICIAL_KEYS) <= keys, sorted(set(OFFICIAL_KEYS) - keys)
    assert model.state_dict()["quantize.codebook_used"].shape == (65536,)
    torch.save({"model": model.state_dict(), "steps": 7}, tmp_path / "vq_ds2.pt")
    loaded = LlamaGenVQ.from_pretrained(tmp_path / "vq_ds2.pt")
    # the architecture is inferred from tensor shapes; image_size is not stored, so it defaults to 256
    assert loaded.config == dataclasses.replace(model.config, image_size=256)
    x = pixels()
    codes = model.encode(x)
    assert torch.equal(loaded.encode(x), codes)
    assert torch.equal(loaded.decode(codes), model.decode(codes))
    assert torch.equal(loaded.codebook(), model.codebook())
    torch.save(model.state_dict(), tmp_path / "plain.pt")  # a bare state dict also loads
    assert torch.equal(LlamaGenVQ.from_pretrained(tmp_path / "plain.pt").encode(x), codes)


def test_default_config_is_official_vq16():
    cfg = VQConfig()
    assert (cfg.codebook_size, cfg.codebook_embed_dim, cfg.ch_mult, cfg.downsample) == (16384, 8, (1, 1, 2, 2, 4), 16)
    with torch.device("meta"):  # shapes only, no memory
        vq = LlamaGenVQ(cfg)
    state = vq.state_dict()
    assert len(state) == 344  # count of the official VQ-16 state dict
    assert state["encoder.conv_blocks.4.attn.1.q.weight"].shape == (512, 512, 1, 1)
    assert infer_config(state) == cfg


def test_loader_rejects_missing_keys_and_unknown_formats(tmp_path):
    state = tiny_model().state_dict()
    del state["decoder.conv_out.weight"]
    torch.save({"model": state}, tmp_path / "broken.pt")
    with pytest.raises(ValueError, match="decoder.conv_out.weight"):
        LlamaGenVQ.from_pretrained(tmp_path / "broken.pt")
    torch.save({"model": "not a state dict"}, tmp_path / "odd.pt")
    with pytest.raises(ValueError, match="unknown checkpoint format"):
        LlamaGenVQ.from_pretrained(tmp_path / "odd.pt")
    (tmp_path / "junk.pt").write_bytes(b"junk")
    with pytest.raises(ValueError, match="not a torch checkpoint"):
        LlamaGenVQ.from_pretrained(tmp_path / "junk.pt")
    with pytest.raises(ValueError, match="config.json"):
        LlamaGenVQ.from_pretrained(tmp_path)


def test_safetensors_round_trip(tmp_path):
    model = tiny_model(seed=3)
    model.save_pretrained(tmp_path / "fp32", dtype=torch.float32)
    model.save_pretrained(tmp_path / "fp16")
    assert json.loads((tmp_path / "fp32" / "config.json").read_text())["ch_mult"] == [1, 2]
    exact = LlamaGenVQ.from_pretrained(tmp_path / "fp32")
    assert exact.config == model.config
    for k, v in model.state_dict().items():
        assert torch.equal(exact.state_dict()[k], v), k
    half = LlamaGenVQ.from_pretrained(tmp_path / "fp16")
    w = model.quantize.embedding.weight
    assert torch.equal(half.quantize.embedding.weight, w.half().float())


def test_encode_decode_shapes_and_code_range():
    model = tiny_model(ch_mult=(1, 1, 2), image_size=32)
    x = pixels(b=3, s=32)
    codes = model.encode(x)
    assert codes.shape == (3, 8, 8) and codes.dtype == torch.long
    assert 0 <= int(codes.min()) and int(codes.max()) < 16
    out = model.decode(codes)
    assert out.shape == x.shape and float(out.abs().max()) <= 1.0
    table = model.codebook()
    assert table.shape == (16, 4) and torch.allclose(table.norm(dim=1), torch.ones(16))
    fwd = model(x)  # training forward: straight-through reconstruction + losses
    assert torch.equal(fwd.codes, codes) and fwd.reconstruction.shape == x.shape
    assert fwd.commit_loss.item() == pytest.approx(0.25 * fwd.vq_loss.item(), rel=1e-5)
    with pytest.raises(ValueError, match="not divisible"):
        model.encode(pixels(s=18))
    with pytest.raises(ValueError, match=r"\[0, 16\)"):
        model.decode(torch.full((1, 2, 2), 16))
    from mmspec.models import LlamaGenVQ

    judge = Path(__file__).resolve().parents[1] / "assets" / "testbed" / "judge"
    with pytest.raises(ValueError, match="judge is not a VQ tokenizer folder"):
        LlamaGenVQ.from_pretrained(judge)  # said only "unknown VQConfig fields"
    for dtype in (torch.float32, torch.uint8, torch.bool):  # a raw IndexError (uint8 / bool index as masks)
        with pytest.raises(ValueError, match="codes must be an integer tensor"):
            model.decode(codes.to(dtype))
    assert torch.equal(model.decode(codes.to(torch.int32)), out)


@pytest.mark.parametrize("kw, field", [
    (dict(image_size=15), "image_size"), (dict(ch=48), "ch"), (dict(codebook_size=0), "codebook_size"),
    (dict(ch_mult=()), "ch_mult"), (dict(dropout=1.5), "dropout"), (dict(decoder_ch_mult=(1,)), "decoder_ch_mult"),
])
def test_bad_config_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**kw)


def test_bundled_testbed_asset_reconstructs_validation_scenes():
    from mmspec.testbed.vq_train import psnr, render, to_pixels

    model = LlamaGenVQ.from_pretrained(ASSET)
    assert model.config.image_size == 64 and model.config.token_grid == 16
    x = to_pixels(render("validation", 8, 64))
    codes = model.encode(x)
    assert codes.shape == (8, 16, 16)
    assert 0 <= int(codes.min()) and int(codes.max()) < model.config.codebook_size
    assert float(psnr(model.decode(codes), x).mean()) >= MIN_ASSET_PSNR
    assert (ASSET / "model.safetensors").stat().st_size < 5 * 2**20



def test_dead_code_restart_moves_only_unused_codes():
    from mmspec.testbed.vq_train import restart_dead_codes

    model = tiny_model()
    before = model.quantize.embedding.weight.detach().clone()
    counts = torch.tensor([0, 3] * 8)
    latents = torch.nn.functional.normalize(torch.randn(32, 4), dim=-1)
    n = restart_dead_codes(model, counts, latents, torch.Generator().manual_seed(0))
    after = model.quantize.embedding.weight.detach()
    assert n == 8
    assert torch.equal(after[1::2], before[1::2])
    moved = after[0::2]
    assert torch.cdist(moved, latents).min(1).values.max() < 0.1  # each sits next to a recent latent


def test_train_config_validation():
    from mmspec.testbed.vq_train import VQTrainConfig

    with pytest.raises(ValueError, match="crop"):
        VQTrainConfig(crop=30)
    with pytest.raises(ValueError, match="image_size"):
        VQTrainConfig(image_size=66, crop=32)


def test_one_official_vq_file_serves_every_grid_and_wrong_shapes_are_named(tmp_path):
    """LlamaGen ships one vq_ds16_c2i.pt for its 256-px and 384-px GPTs; the grid is a setting
    (`image_size=`), not in the weights: loaded at 256 px it could not be paired with a 384-px
    GPT, and the refusal did not say how. A config that does not fit the file was a raw
    RuntimeError."""
    from mmspec.models.llamagen_gpt import LlamaGenGPT
    from mmspec.models.llamagen_vq_model import LlamaGenVQModel
    from mmspec.pipelines import SpeculativeARImagePipeline

    from test_llamagen_gpt import tiny_model as tiny_gpt

    model = tiny_model()  # downsample 2
    torch.save({"model": model.state_dict()}, tmp_path / "vq.pt")
    at8 = LlamaGenVQ.from_pretrained(tmp_path / "vq.pt", image_size=8)
    assert at8.config.image_size == 8 and at8.config.token_grid == 4
    x = pixels(s=8)
    assert torch.equal(at8.encode(x), model.encode(x))  # the same weights, another grid
    gpt = tiny_gpt(seed=1, vocab_size=16).float()  # block_size 16: a 4x4 grid
    assert isinstance(gpt, LlamaGenGPT)
    with pytest.raises(ValueError, match=r"grid mismatch: the VQ decodes 128x128 tokens but the target GPT generates "
                                         r"block_size=16; the VQ is convolutional: load it for 8-px images, e\.g\. "
                                         r"LlamaGenVQ.from_pretrained\(file, image_size=8\)"):
        SpeculativeARImagePipeline(target=gpt, vq=LlamaGenVQModel.from_vq(LlamaGenVQ.from_pretrained(tmp_path / "vq.pt")))
    pipe = SpeculativeARImagePipeline(target=gpt, vq=LlamaGenVQModel.from_vq(at8))
    assert pipe.vq.token_grid == 4
    for wrong in (dict(codebook_size=32), dict(codebook_embed_dim=8)):
        with pytest.raises(ValueError, match=r"vq.pt: state dict does not match VQConfig: \d+ tensors of other shapes"):
            LlamaGenVQ.from_pretrained(tmp_path / "vq.pt", tiny_config(**wrong))


def test_image_size_is_an_int_and_honoured_from_a_vq_folder(tmp_path):
    from mmspec.models.llamagen_vq_model import LlamaGenVQModel

    model = tiny_model()
    model.save_pretrained(tmp_path / "vq")
    wrapped = LlamaGenVQModel.from_pretrained(tmp_path / "vq", image_size=8)  # (it was ignored for such a folder)
    assert wrapped.token_grid == 4 and LlamaGenVQModel.from_pretrained(tmp_path / "vq").token_grid == 8
    for bad in ("8", 8.0, True):  # a str was a raw TypeError, a float gave a float grid
        with pytest.raises(ValueError, match=r"VQConfig.image_size must be an int >= 1"):
            tiny_config(image_size=bad)
