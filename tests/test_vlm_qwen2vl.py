"""Qwen2-VL through `HFTarget` (chosen by model type: `Qwen2VLSpec`, M-RoPE positions with
per-row rope deltas): a tiny random config saved and re-loaded with `from_pretrained` decodes
greedily exactly like its own `generate` run row by row (batch of 4, different prompt lengths
and image sizes, left padding, chains and trees, rows leaving at EOS), and exact sampling is
distributed like plain sampling (chi-square against the enumerated joint, with a power check)."""

from __future__ import annotations

import pytest
import torch

import mmspec
from mmspec.drafters import ModelDrafter
from mmspec.models.hf_spec import HFSpec
from mmspec.models.qwen2vl_spec import Qwen2VLSpec

from _vlm_helpers import assert_rows_equal, left_pad
from conftest import tiny_qwen2vl_config
from test_core_sampling import chi_square_p

V, IMG, VS, VE = 64, 60, 58, 59
PATCH = 3 * 1 * 2 * 2  # channels * temporal_patch * patch * patch


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from transformers import Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen2vl")
    model = Qwen2VLForConditionalGeneration(tiny_qwen2vl_config(V, IMG))
    with torch.no_grad():  # sharper attention, so that positions visibly change the answers
        for name, p in model.model.language_model.named_parameters():
            if "q_proj.weight" in name or "k_proj.weight" in name:
                p.mul_(6.0)
    model.save_pretrained(path)
    model = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float64, attn_implementation="sdpa")
    return model.eval()


def text_drafter(model):
    """A Qwen2 causal LM with the VLM's own language model weights (a good text-only drafter)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    t = model.config.text_config
    cfg = Qwen2Config(vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                      num_hidden_layers=t.num_hidden_layers, num_attention_heads=t.num_attention_heads,
                      num_key_value_heads=t.num_key_value_heads, pad_token_id=0)
    lm = Qwen2ForCausalLM(cfg).to(torch.float64).eval()
    lm.model.load_state_dict(model.model.language_model.state_dict())
    lm.lm_head.load_state_dict(model.lm_head.state_dict())
    return lm


def weak_drafter():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(4)
    cfg = Qwen2Config(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, pad_token_id=0)
    return Qwen2ForCausalLM(cfg).to(torch.float64).eval()


def batch(grids, texts_before, texts_after, seed=0):
    """Left-padded batch: [text, VS, image tokens, VE, text] per row, and the flat pixel patches."""
    g = torch.Generator().manual_seed(seed)
    rows, pixels = [], []
    for (h, w), nb, na in zip(grids, texts_before, texts_after):
        n_img = (h // 2) * (w // 2)
        row = torch.cat([torch.randint(3, 50, (nb,), generator=g), torch.tensor([VS]), torch.full((n_img,), IMG),
                         torch.tensor([VE]), torch.randint(3, 50, (na,), generator=g)])
        rows.append(row)
        pixels.append(torch.randn(h * w, PATCH, generator=g, dtype=torch.float64))
    ids, mask = left_pad(rows)
    grid = torch.tensor([[1, h, w] for h, w in grids])
    return ids, mask, torch.cat(pixels), grid


def row_inputs(ids, mask, pixels, grid, b):
    """Row b's unpadded inputs, as its own processor call would give them."""
    start = int(grid[:b].prod(-1).sum())
    real = ids[b][mask[b].bool()].unsqueeze(0)
    return dict(input_ids=real, attention_mask=torch.ones_like(real), pixel_values=pixels[start:start + int(grid[b].prod())],
                image_grid_thw=grid[b:b + 1], mm_token_type_ids=(real == IMG).int())


GRIDS = [(4, 4), (4, 6), (6, 4), (2, 4)]


@torch.no_grad()
def reference(model, ids, mask, pixels, grid, n, eos):
    refs = []
    for b in range(ids.shape[0]):
        inp = row_inputs(ids, mask, pixels, grid, b)
        out = model.generate(**inp, do_sample=False, max_new_tokens=n, eos_token_id=eos, pad_token_id=0)
        refs.append(out[0, inp["input_ids"].shape[1]:])
    return refs


@pytest.mark.parametrize("tree", [None, mmspec.TreeConfig(depth=3, top_k=2, num_nodes=6)], ids=["chain", "tree"])
def test_qwen2vl_greedy_equals_generate_row_by_row(qwen, tree):
    ids, mask, pixels, grid = batch(GRIDS, [1, 4, 2, 6], [3, 2, 5, 1])
    n = 12
    plain = reference(qwen, ids, mask, pixels, grid, n, eos=None)
    eos = int(plain[1][4])  # row 1 ends early (by its 5th token); others may too
    refs = reference(qwen, ids, mask, pixels, grid, n, eos=eos)
    types = (ids == IMG).int()
    accepted = []
    for dm in (text_drafter(qwen), weak_drafter()):
        out = mmspec.speculative_generate(
            qwen, (ModelDrafter(dm, tree=tree) if tree else ModelDrafter(dm, 3)), ids, mask, temperature=0, max_new_tokens=n, pixel_values=pixels,
            image_grid_thw=grid, mm_token_type_ids=types, eos_token_id=eos, pad_token_id=0)
        assert_rows_equal(out.sequences, ids.shape[1], refs)
        assert out.stats.new_tokens == [len(r) for r in refs]
        assert out.stats.new_tokens[1] < n  # row 1 left the batch early (EOS)
        accepted.append(out.stats.accepted_drafts)
    assert accepted[0] > 0  # the VLM's own language model drafts some of the answer right


@torch.no_grad()
def test_mrope_positions_matter_and_token_types_are_derived(qwen):
    """Without `mm_token_type_ids` the spec derives them from the image token id; a target on 1-D
    positions (the generic spec) decodes differently, so the equality above tests M-RoPE."""
    ids, mask, pixels, grid = batch(GRIDS[:2], [2, 3], [4, 2], seed=1)
    refs = reference(qwen, ids, mask, pixels, grid, 10, eos=None)
    target = mmspec.models.HFTarget(qwen)
    assert isinstance(target.spec, Qwen2VLSpec)
    out = mmspec.speculative_generate(target, ModelDrafter(text_drafter(qwen), 2), ids, mask, temperature=0,
                                      max_new_tokens=10, pixel_values=pixels, image_grid_thw=grid)
    assert_rows_equal(out.sequences, ids.shape[1], refs)
    wrong = mmspec.SpecTarget(HFSpec(qwen))
    bad = mmspec.speculative_generate(wrong, ModelDrafter(text_drafter(qwen), 2), ids, mask, temperature=0,
                                      max_new_tokens=10, pixel_values=pixels, image_grid_thw=grid,
                                      mm_token_type_ids=(ids == IMG).int())
    assert not torch.equal(bad.sequences, out.sequences)


@torch.no_grad()
def test_qwen2vl_image_features_and_positions_are_returned(qwen):
    from test_core_features import Recording

    ids, mask, pixels, grid = batch(GRIDS[:2], [2, 3], [4, 2], seed=2)
    req = mmspec.FeatureRequest(last_hidden=True, image_features=True, positions=True)
    drafter = Recording(text_drafter(qwen), req)
    mmspec.speculative_generate(qwen, drafter, ids, mask, temperature=0, max_new_tokens=5, pixel_values=pixels,
                                image_grid_thw=grid)
    pre, step = drafter.seen[0], drafter.seen[1]
    feats = qwen.model.get_image_features(pixels, grid).pooler_output
    torch.testing.assert_close(pre.image_features, torch.cat(feats))
    types = (ids == IMG).int()
    pos, deltas = qwen.model.get_rope_index(ids, mm_token_type_ids=types, image_grid_thw=grid, attention_mask=mask)
    assert torch.equal(pre.positions, pos)
    # The first verify's root sits right after each row's prompt: logical length + delta.
    assert torch.equal(step.positions[:, :, 0], (mask.sum(1, keepdim=True) + deltas).T.expand(3, -1))


def test_unknown_mrope_models_are_refused():
    from mmspec.models.hf_target import check_supported

    class FakeConfig:
        model_type = "qwen3_vl"

    class Fake(torch.nn.Module):
        config = FakeConfig()

        def forward(self, input_ids=None, image_grid_thw=None):  # pragma: no cover - never run
            raise AssertionError

    with pytest.raises(ValueError, match="qwen3_vl.*M-RoPE"):
        check_supported(Fake())


# ---- exact sampling ---------------------------------------------------------------------------
SAMPLES = 3000
TOP_K = 4


@torch.no_grad()
def enumerated_joint(model, inp, sampling, n=3):
    """P(t1, t2, t3) of plain sampling, enumerated with cache-free forwards: {tokens: prob}."""
    out = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for prefix, p in out.items():
            ids = torch.cat([inp["input_ids"], torch.tensor([list(prefix)], dtype=torch.long)], 1)
            types = torch.cat([inp["mm_token_type_ids"], torch.zeros(1, len(prefix), dtype=torch.int)], 1)
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=inp["pixel_values"],
                           image_grid_thw=inp["image_grid_thw"], mm_token_type_ids=types).logits[:, -1]
            probs = mmspec.process_logits(logits, sampling)[0]
            for t in probs.nonzero().flatten().tolist():
                nxt[prefix + (t,)] = p * float(probs[t])
        out = nxt
    return out


@pytest.mark.parametrize("tree", [None, mmspec.TreeConfig(depth=2, top_k=2, num_nodes=4)], ids=["chain", "tree"])
def test_qwen2vl_exact_sampling_matches_plain_sampling(qwen, tree):
    import copy

    qwen = copy.deepcopy(qwen)
    with torch.no_grad():  # a peaked distribution, so that the power check has something to see
        qwen.lm_head.weight.mul_(8.0)
    ids, mask, pixels, grid = batch([(4, 4)], [2], [3], seed=3)
    inp = row_inputs(ids, mask, pixels, grid, 0)
    sampling = mmspec.SamplingConfig(1.0, TOP_K)
    expected = enumerated_joint(qwen, inp, sampling)
    hotter = enumerated_joint(qwen, inp, mmspec.SamplingConfig(2.0, TOP_K))
    L = ids.shape[1]
    out = mmspec.speculative_generate(
        qwen, (ModelDrafter(weak_drafter(), tree=tree) if tree else ModelDrafter(weak_drafter(), 2)), ids.expand(SAMPLES, -1), acceptance="exact",
        temperature=1.0, top_k=TOP_K, max_new_tokens=3, pixel_values=pixels.repeat(SAMPLES, 1),
        image_grid_thw=grid.expand(SAMPLES, -1), generator=torch.Generator().manual_seed(11))
    keys = sorted(set(expected) | set(hotter))
    index = {k: i for i, k in enumerate(keys)}
    counts = torch.zeros(len(keys))
    for row in out.sequences[:, L:L + 3].tolist():
        counts[index[tuple(row)]] += 1  # a KeyError here is a sample outside the support
    exp = torch.tensor([expected.get(k, 0.0) for k in keys], dtype=torch.float64)
    hot = torch.tensor([hotter.get(k, 0.0) for k in keys], dtype=torch.float64)
    assert chi_square_p(counts, exp, SAMPLES) > 1e-4
    assert chi_square_p(counts, hot, SAMPLES) < 1e-4  # power: a different temperature is rejected
    assert out.stats.row_steps > SAMPLES  # several verify steps per row: rejections exercised


@pytest.mark.parametrize("tree", [None, mmspec.TreeConfig(depth=3, top_k=2, num_nodes=6)], ids=["chain", "tree"])
def test_qwen25vl_greedy_equals_generate_row_by_row(tmp_path, tree):
    """Qwen2.5-VL (windowed vision tower, same M-RoPE scheme) through the same spec."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    base = tiny_qwen2vl_config(V, IMG)
    vision = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=2, spatial_merge_size=2,
                  temporal_patch_size=1, in_channels=3, out_hidden_size=32, window_size=4, fullatt_block_indexes=[1])
    cfg = Qwen2_5_VLConfig(text_config=base.text_config.to_dict(), vision_config=vision, image_token_id=IMG,
                           video_token_id=IMG + 1, vision_start_token_id=VS, vision_end_token_id=VE)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, p in model.model.language_model.named_parameters():
            if "q_proj.weight" in name or "k_proj.weight" in name:
                p.mul_(6.0)
    model.save_pretrained(tmp_path)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float64).eval()
    ids, mask, pixels, grid = batch(GRIDS, [1, 4, 2, 6], [3, 2, 5, 1], seed=9)
    refs = reference(model, ids, mask, pixels, grid, 10, eos=None)
    target = mmspec.models.HFTarget(model)
    assert isinstance(target.spec, Qwen2VLSpec)
    dm = text_drafter(model)  # the VLM's own language model: drafts kept and (1-D positions) drafts rejected
    out = mmspec.speculative_generate(target, (ModelDrafter(dm, tree=tree) if tree else ModelDrafter(dm, 3)), ids, mask,
                                      temperature=0, max_new_tokens=10, pixel_values=pixels, image_grid_thw=grid)
    assert_rows_equal(out.sequences, ids.shape[1], refs)
    assert 0 < out.stats.accepted_drafts < out.stats.drafted_nodes
    flat = mmspec.speculative_generate(mmspec.SpecTarget(HFSpec(model)), ModelDrafter(weak_drafter(), 3), ids, mask,
                                       temperature=0, max_new_tokens=10, pixel_values=pixels, image_grid_thw=grid,
                                       mm_token_type_ids=(ids == IMG).int())
    assert not torch.equal(flat.sequences, out.sequences)  # 1-D positions would be wrong here


@torch.no_grad()
def test_qwen2vl_text_only_prompts(qwen):
    """No image inputs: M-RoPE streams all equal the logical position (deltas 0)."""
    from conftest import left_padded

    from conftest import noisy_copy

    ids, mask = left_padded([5, 8, 3], vocab=50)
    out = mmspec.speculative_generate(qwen, ModelDrafter(noisy_copy(text_drafter(qwen), 0.3), 3), ids, mask,
                                      temperature=0, max_new_tokens=8)
    assert 0 < out.stats.accepted_drafts < out.stats.drafted_nodes  # drafts kept and drafts rejected
    for b in range(3):
        real = ids[b][mask[b].bool()].unsqueeze(0)
        ref = qwen.generate(input_ids=real, attention_mask=torch.ones_like(real), do_sample=False, max_new_tokens=8,
                            eos_token_id=None, pad_token_id=0)[0, real.shape[1]:]
        assert torch.equal(out.sequences[b, ids.shape[1]:], ref)


def test_qwen2vl_placeholders_without_pixels_are_refused(qwen):
    ids = torch.tensor([[5, 58, 60, 60, 59, 7]])  # vision start, two image tokens, vision end
    with pytest.raises(ValueError, match=r"image placeholder tokens \(id 60\) but no pixel_values"):
        mmspec.speculative_generate(qwen, ModelDrafter(weak_drafter(), 2), ids, temperature=0, max_new_tokens=4)
    ids[0, 2:4] = 61  # video placeholders
    with pytest.raises(ValueError, match=r"video placeholder tokens \(id 61\) but no pixel_values_videos"):
        mmspec.speculative_generate(qwen, ModelDrafter(weak_drafter(), 2), ids, temperature=0, max_new_tokens=4)


def test_custom_generate_with_images_is_refused_by_name_on_qwen2vl(qwen):
    """generate encodes the images before a custom loop and drops image_grid_thw with the pixels;
    mmspec's Qwen2-VL spec needs it for M-RoPE positions: refused by name, pointing to
    speculative_generate (which answers as generate does, test above)."""
    from mmspec.models.hf_generate import speculative_decoding

    ids, mask, pixels, grid = batch(GRIDS[:1], [2], [3])
    inp = row_inputs(ids, mask, pixels, grid, 0)
    with pytest.raises(ValueError, match="drops image_grid_thw.*mmspec.speculative_generate"):
        qwen.generate(**inp, do_sample=False, max_new_tokens=4, pad_token_id=0, custom_generate=speculative_decoding,
                      drafter=ModelDrafter(text_drafter(qwen), 2))


def test_video_prompts_decode_like_generate_with_feature_heads():
    """The heads' image features were caught on the vision merger, which merges videos too: a
    prompt with a video and no image handed them 8 'image' features for 0 image tokens (a
    ValueError). Image features now come from the base output (the images' only)."""
    from transformers import Qwen2VLForConditionalGeneration

    from conftest import tiny_qwen2vl_config
    from mmspec.drafters import EagleHead, EagleHeadConfig, EagleHeadDrafter, ViSpecDrafter, ViSpecHead

    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(tiny_qwen2vl_config(64, 60)).double().eval()
    g = torch.Generator().manual_seed(3)
    ids = torch.cat([torch.randint(3, 50, (2,), generator=g), torch.tensor([58]), torch.full((8,), 61),
                     torch.tensor([59]), torch.randint(3, 50, (3,), generator=g)]).unsqueeze(0)  # 2 x 4 x 4 video
    video = dict(pixel_values_videos=torch.randn(32, 12, generator=g, dtype=torch.float64),
                 video_grid_thw=torch.tensor([[2, 4, 4]]))
    ref = model.generate(input_ids=ids, **video, do_sample=False, max_new_tokens=8, pad_token_id=0)
    torch.manual_seed(1)
    heads = [EagleHeadDrafter(model, EagleHead(EagleHeadConfig.for_target(model)).double(), 3),
             ViSpecDrafter(model, ViSpecHead(EagleHeadConfig.for_target(model, kind="vispec")).double(), 2)]
    for drafter in heads:
        out = mmspec.speculative_generate(model, drafter, ids, temperature=0, max_new_tokens=8, pad_token_id=0, **video)
        assert torch.equal(out.sequences, ref), type(drafter).__name__


def test_pixels_without_their_grid_are_refused_by_name(qwen):
    """They failed deep in transformers' vision utils ("'NoneType' object has no attribute 'device'")."""
    ids, mask, pixels, grid = batch([(4, 4)], [2], [3])
    for inputs, missing in ((dict(pixel_values=pixels), "pixel_values without image_grid_thw"),
                            (dict(pixel_values=pixels, image_grid_thw=grid, pixel_values_videos=pixels),
                             "pixel_values_videos without video_grid_thw")):
        with pytest.raises(ValueError, match=missing):
            mmspec.speculative_generate(qwen, ModelDrafter(text_drafter(qwen), 2), ids, mask, temperature=0,
                                        max_new_tokens=2, **inputs)
