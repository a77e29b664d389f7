"""HF VLMs are wrapped automatically: a tiny LLaVA (saved and re-loaded with
`save_pretrained` / `from_pretrained`, the real checkpoint format) decodes greedily with a
text-only drafter exactly like its own `generate`, images passed as `pixel_values`."""

from __future__ import annotations

import pytest
import torch

import mmspec
from mmspec.drafters import ModelDrafter

from conftest import tiny_llava_config

IMG = 60
V = 64


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    from transformers import LlavaForConditionalGeneration

    torch.manual_seed(0)
    cfg = tiny_llava_config(V, IMG)
    text = cfg.text_config
    path = tmp_path_factory.mktemp("llava")
    LlavaForConditionalGeneration(cfg).save_pretrained(path)
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float64, attn_implementation="sdpa")
    return model.eval(), text


def test_llava_greedy_equals_generate(llava):
    from transformers import LlamaForCausalLM

    model, text = llava
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 50, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    ids[1, :2] = 0
    mask[2, :4] = 0
    ids[2, :4] = 0
    for b, start in enumerate([1, 3, 5]):
        ids[b, start : start + 4] = IMG  # 2x2 patches -> 4 image tokens per row
    pixels = torch.randn(3, 3, 16, 16, dtype=torch.float64, generator=g)
    ref = model.generate(input_ids=ids, attention_mask=mask, pixel_values=pixels, do_sample=False,
                         max_new_tokens=12, pad_token_id=0, eos_token_id=2)
    torch.manual_seed(1)
    drafter = LlamaForCausalLM(text).double().eval()
    for dm in (drafter, _text_only(model)):  # a weak text drafter, and the VLM's own language model
        out = mmspec.speculative_generate(model, ModelDrafter(dm, 3), ids, mask, temperature=0, max_new_tokens=12,
                                          pixel_values=pixels, pad_token_id=0, eos_token_id=2)
        assert torch.equal(out.sequences, ref), (out.sequences[:, 9:], ref[:, 9:])


def _text_only(model):
    """The VLM's own language model + LM head as a (perfect on text) causal-LM drafter."""
    from transformers import LlamaForCausalLM

    lm = LlamaForCausalLM(model.config.text_config).to(torch.float64).eval()
    lm.model.load_state_dict(model.model.language_model.state_dict())
    lm.lm_head.load_state_dict(model.lm_head.state_dict())
    return lm


def test_pixel_values_change_the_output(llava):
    model, _ = llava
    ids = torch.tensor([[5, IMG, IMG, IMG, IMG, 7, 9]])
    a = mmspec.speculative_generate(model, ModelDrafter(_text_only(model), 2), ids, temperature=0, max_new_tokens=8,
                                    pixel_values=torch.zeros(1, 3, 16, 16, dtype=torch.float64))
    b = mmspec.speculative_generate(model, ModelDrafter(_text_only(model), 2), ids, temperature=0, max_new_tokens=8,
                                    pixel_values=torch.ones(1, 3, 16, 16, dtype=torch.float64) * 3)
    assert not torch.equal(a.sequences, b.sequences)


def test_image_placeholders_without_pixels_are_refused(llava):
    """transformers embeds the placeholders as text and answers about no image at all; refused."""
    model, _ = llava
    ids = torch.tensor([[5, IMG, IMG, IMG, IMG, 7, 9]])
    with pytest.raises(ValueError, match=r"input_ids hold image placeholder tokens \(id 60\) but no pixel_values"):
        mmspec.speculative_generate(model, ModelDrafter(_text_only(model), 2), ids, temperature=0, max_new_tokens=4)
    text_only = torch.tensor([[5, 6, 7, 9]])  # no placeholders: a text-only request runs
    mmspec.speculative_generate(model, ModelDrafter(_text_only(model), 2), text_only, temperature=0, max_new_tokens=4)


def test_image_sizes_for_a_clip_tower_llava_are_refused(llava):
    """transformers' own generate fails deep in the CLIP tower ('no attribute patch_size')."""
    model, _ = llava
    ids = torch.tensor([[5, IMG, IMG, IMG, IMG, 7, 9]])
    pixels = torch.zeros(1, 3, 16, 16, dtype=torch.float64)
    with pytest.raises(AttributeError, match="patch_size"):
        model.generate(ids, pixel_values=pixels, image_sizes=torch.tensor([[16, 16]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="image_sizes was given to a LLaVA with a CLIPVisionModel vision tower"):
        mmspec.speculative_generate(model, ModelDrafter(_text_only(model), 2), ids, temperature=0, max_new_tokens=4,
                                    pixel_values=pixels, image_sizes=torch.tensor([[16, 16]]))


# ---- batch of 4, chains and trees, row by row; LLaVA-NeXT (image_sizes); image features ------------
from _vlm_helpers import assert_rows_equal, left_pad  # noqa: E402


def llava_batch(n_text: list[tuple[int, int]], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = [torch.cat([torch.randint(3, 50, (a,), generator=g), torch.full((4,), IMG), torch.randint(3, 50, (b,), generator=g)])
            for a, b in n_text]
    ids, mask = left_pad(rows)
    return ids, mask, torch.randn(len(rows), 3, 16, 16, dtype=torch.float64, generator=g)


@torch.no_grad()
def row_by_row(model, ids, mask, n, eos, **images):
    refs = []
    for b in range(ids.shape[0]):
        real = ids[b][mask[b].bool()].unsqueeze(0)
        extra = {k: v[b:b + 1] for k, v in images.items()}
        out = model.generate(input_ids=real, attention_mask=torch.ones_like(real), do_sample=False, max_new_tokens=n,
                             eos_token_id=eos, pad_token_id=0, **extra)
        refs.append(out[0, real.shape[1]:])
    return refs


@pytest.mark.parametrize("tree", [None, mmspec.TreeConfig(depth=3, top_k=2, num_nodes=6)], ids=["chain", "tree"])
def test_llava_batch_of_four_equals_generate_row_by_row(llava, tree):
    model, _ = llava
    ids, mask, pixels = llava_batch([(1, 2), (4, 1), (2, 5), (6, 3)])
    plain = row_by_row(model, ids, mask, 12, None, pixel_values=pixels)
    eos = int(plain[2][3])
    refs = row_by_row(model, ids, mask, 12, eos, pixel_values=pixels)
    out = mmspec.speculative_generate(model, (ModelDrafter(_text_only(model), tree=tree) if tree else ModelDrafter(_text_only(model), 3)), ids, mask, temperature=0,
                                      max_new_tokens=12, pixel_values=pixels, eos_token_id=eos, pad_token_id=0)
    assert_rows_equal(out.sequences, ids.shape[1], refs)
    assert out.stats.new_tokens == [len(r) for r in refs] and min(out.stats.new_tokens) < 12


@pytest.fixture(scope="module")
def llava_next(tmp_path_factory):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig, LlavaNextForConditionalGeneration

    text = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, pad_token_id=0)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                              image_size=16, patch_size=8, projection_dim=32)
    cfg = LlavaNextConfig(vision_config=vision, text_config=text, image_token_index=IMG, vision_feature_layer=-1,
                          vision_feature_select_strategy="default", image_grid_pinpoints=[[16, 32], [32, 16], [32, 32]])
    torch.manual_seed(2)
    path = tmp_path_factory.mktemp("llava_next")
    LlavaNextForConditionalGeneration(cfg).save_pretrained(path)
    return LlavaNextForConditionalGeneration.from_pretrained(path, dtype=torch.float64, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("tree", [None, mmspec.TreeConfig(depth=2, top_k=2, num_nodes=4)], ids=["chain", "tree"])
def test_llava_next_image_sizes_equal_generate_row_by_row(llava_next, tree):
    """Different image sizes give different numbers of image tokens (anyres tiles, unpadding,
    newline tokens); the target passes `image_sizes` to the model's own prefill."""
    model = llava_next
    g = torch.Generator().manual_seed(5)
    sizes = torch.tensor([[16, 32], [30, 20], [32, 32], [12, 16]])
    pixels = torch.randn(4, 5, 3, 16, 16, dtype=torch.float64, generator=g)
    feats = model.model.get_image_features(pixels, sizes, vision_feature_layer=-1,
                                           vision_feature_select_strategy="default").pooler_output
    counts = [f.shape[0] for f in feats]
    assert len(set(counts)) > 1
    rows = [torch.cat([torch.randint(3, 50, (a,), generator=g), torch.full((c,), IMG), torch.randint(3, 50, (2,), generator=g)])
            for a, c in zip([1, 3, 2, 4], counts)]
    ids, mask = left_pad(rows)
    refs = row_by_row(model, ids, mask, 10, None, pixel_values=pixels, image_sizes=sizes)
    target = mmspec.models.HFTarget(model)
    from test_core_features import Recording

    drafter = Recording(_text_only(model), mmspec.FeatureRequest(image_features=True))
    drafter.tree = tree
    drafter.max_draft_nodes = tree.num_nodes if tree else 2
    out = mmspec.speculative_generate(target, drafter, ids, mask, temperature=0, max_new_tokens=10,
                                      pixel_values=pixels, image_sizes=sizes)
    assert_rows_equal(out.sequences, ids.shape[1], refs)
    # The image is encoded once, at prefill; its merged features come back in order.
    torch.testing.assert_close(drafter.seen[0].image_features.reshape(-1, 32), torch.cat(feats))
    assert all(o.image_features is None for o in drafter.seen[1:])


def test_llava_image_features_are_returned(llava):
    from test_core_features import Recording

    model, _ = llava
    ids, mask, pixels = llava_batch([(1, 2), (3, 1)], seed=4)
    drafter = Recording(_text_only(model), mmspec.FeatureRequest(image_features=True, last_hidden=True))
    mmspec.speculative_generate(model, drafter, ids, mask, temperature=0, max_new_tokens=4, pixel_values=pixels)
    feats = model.model.get_image_features(pixels, vision_feature_layer=-1,
                                           vision_feature_select_strategy="default").pooler_output
    torch.testing.assert_close(drafter.seen[0].image_features.reshape(-1, 32), torch.cat(list(feats)).reshape(-1, 32))


def test_image_features_read_from_image_outputs_not_the_deprecated_alias():
    """transformers 5.24 keeps `image_hidden_states` as an alias of `image_outputs.pooler_output`
    and announces that from 5.30 it returns every layer's hidden states: the spec reads
    `image_outputs` where the output class has that field, and the alias only on older classes."""
    from dataclasses import dataclass
    from types import SimpleNamespace

    from transformers.models.llava.modeling_llava import LlavaModelOutputWithPast

    from mmspec.models.hf_spec import _pooled_image_features

    pooled, other = torch.ones(2, 3), torch.zeros(5, 3)

    @dataclass
    class Future:  # the announced change: the alias returns something else
        image_outputs: object = None

        @property
        def image_hidden_states(self):
            return other

    assert _pooled_image_features(Future(SimpleNamespace(pooler_output=pooled))) is pooled
    assert _pooled_image_features(Future(None)) is None  # a text-only step
    assert _pooled_image_features(SimpleNamespace(image_hidden_states=other)) is other  # older classes
    assert "image_outputs" in LlavaModelOutputWithPast.__dataclass_fields__  # the installed version's layout


def test_custom_generate_with_images_equals_plain_generate(llava):
    """transformers 5's generate encodes the images before it calls a custom loop and passes
    `mm_encoder_outputs` instead of `pixel_values`; mmspec refused that as "placeholders without
    pixel_values". Now a LLaVA batch with images through generate(custom_generate=...) answers
    exactly as plain generate."""
    from mmspec.models.hf_generate import speculative_decoding

    model, _ = llava
    ids, mask, pixels = llava_batch([(2, 3)])
    kw = dict(input_ids=ids, attention_mask=mask, pixel_values=pixels, do_sample=False, max_new_tokens=10, pad_token_id=0)
    ref = model.generate(**kw)
    out = model.generate(**kw, custom_generate=speculative_decoding, drafter=ModelDrafter(_text_only(model), 3))
    assert torch.equal(out, ref)
    blank = model.generate(**{**kw, "pixel_values": torch.zeros_like(pixels)})
    assert not torch.equal(blank, ref)  # the image matters to the answer, so the check above could fail
