"""Tensors made under torch.inference_mode() (no version counter for the caches to key on), models
whose layers mix dtypes, per-wrap kernel policies, and inputs refused by dtype or device: models
and pipelines built or called inside inference_mode decode as outside it, a mixed-dtype model
runs stock kernels (prepack=True refused by name), two wraps of one model keep their own
`prepack`, integer labels of any width are class ids, and meta / cross-device tensors, unusable
torch dtypes and a float Qwen2-VL grid are refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mmspec
from mmspec.drafters import ModelDrafter, NullDrafter
from mmspec.models.hf_target import HFTarget
from mmspec.models.prepack import PackedLinear, prepack_available

from conftest import left_padded, noisy_copy, tiny_llama

V = 40
needs_onednn = pytest.mark.skipif(not prepack_available(), reason="torch built without oneDNN")


def greedy(model, ids, mask, n: int = 8):
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                         pad_token_id=0, eos_token_id=None, output_scores=True, return_dict_in_generate=True)
    top2 = torch.stack(out.scores, 1).topk(2, -1).values
    assert float((top2[..., 0] - top2[..., 1]).min()) > 1e-4  # no near-tie for float32 rounding to flip
    return out.sequences


def spec(target, drafter, ids, mask, n: int = 8):
    return mmspec.speculative_generate(target, drafter, ids, mask, temperature=0, max_new_tokens=n, eos_token_id=None)


# ---- 1. inference tensors ---------------------------------------------------------------------
@pytest.mark.parametrize("rule", ["exact", "lantern", "gsd"])
def test_ar_pipeline_built_and_called_in_inference_mode(rule):
    """The float32 AR pipeline built inside inference_mode (its weights are inference tensors:
    prepack "auto" measured and packed them, and the version-keyed caches of LANTERN / GSD read
    their version counter) gives the tokens of the same calls outside, greedy and sampled."""
    from test_ar_image_pipeline import make_pipe

    def calls(pipe):  # greedy, and sampled with a seed
        return [pipe([1, 3], acceptance=rule, output_type="latent", temperature=0),
                pipe([1, 3], acceptance=rule, output_type="latent", generator=torch.Generator().manual_seed(0))]

    with torch.inference_mode():
        inside = calls(make_pipe(torch.float32))
    assert inside[0].stats.kernels == "target stock, drafter stock"  # inference weights are never packed
    outside = make_pipe(torch.float32)
    outside.prepack = False  # the same (stock) kernels
    ref = calls(outside)
    with torch.inference_mode():  # a pipeline built outside, called inside (codebook / embeddings made inside)
        again = outside([1, 3], acceptance=rule, output_type="latent", temperature=0)
    for a, b in zip(inside, ref):
        assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(again.tokens, ref[0].tokens)


def test_rules_on_inference_tensors_follow_in_place_edits():
    """LANTERN's neighbour lists and GSD's distance table are not cached for inference tensors
    (an in-place edit inside inference_mode changes no version): an edited codebook is seen."""
    from mmspec.acceptance import RULES
    from mmspec.acceptance.lantern import nearest_neighbours

    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        cb = torch.randn(24, 4, generator=g)
    first = nearest_neighbours(cb, 3).clone()
    with torch.inference_mode():
        cb.copy_(torch.randn(24, 4, generator=g))
    assert torch.equal(nearest_neighbours(cb, 3), nearest_neighbours(cb.clone(), 3))
    assert not torch.equal(first, nearest_neighbours(cb, 3))
    gsd = RULES["gsd"](embeddings=cb, distance_threshold=1.0)
    x, tokens = torch.tensor([1, 2]), torch.tensor([[3, 4], [5, 6]])
    d2 = gsd._distances(x, tokens, gsd.embeddings)
    assert torch.allclose(d2, (cb[tokens] - cb[x].unsqueeze(1)).pow(2).sum(-1))
    with torch.inference_mode():
        cb.mul_(2.0)
    assert torch.allclose(gsd._distances(x, tokens, gsd.embeddings), 4 * d2)


def test_hf_model_made_in_inference_mode_decodes_like_generate():
    """A float32 model created under inference_mode: the default prepack="auto" keeps stock
    kernels, prepack=True is refused by name, and speculative greedy equals plain greedy."""
    with torch.inference_mode():
        model = tiny_llama(2, 0, dtype=torch.float32)
        draft = noisy_copy(model, 0.3)
    assert next(model.parameters()).is_inference()
    ids, mask = left_padded([7, 4, 6])
    ref = greedy(model, ids, mask)
    target = HFTarget(model)
    assert target.kernels == "stock"
    for drafter in (NullDrafter(V), ModelDrafter(draft, 3)):
        out = spec(target, drafter, ids, mask)
        assert torch.equal(out.sequences, ref)
    assert out.stats.accepted_drafts > 0
    if prepack_available():
        with pytest.raises(ValueError, match=r"prepack=True but .*made under torch.inference_mode\(\)"):
            HFTarget(model, prepack=True)


def test_eagle_head_made_in_inference_mode_drafts_and_follows_edits():
    """An EAGLE head (and its target) made under inference_mode drafts as the same head made
    outside it, and an in-place edit of its weights inside inference_mode is not hidden by the
    stacked-weight cache (which keyed on the version counter)."""
    from _eagle_helpers import distilled_head
    from mmspec.drafters import EagleHead, EagleHeadDrafter

    ids, mask = left_padded([7, 4, 6])
    model = tiny_llama(2, 0)
    head = distilled_head(model, "eagle", ids, mask, steps=60)
    with torch.inference_mode():
        model_inf = tiny_llama(2, 0)
        head_inf = EagleHead(head.config).double().eval()
        head_inf.load_state_dict(head.state_dict())
    assert torch.equal(model_inf.lm_head.weight, model.lm_head.weight) and head_inf.fc.weight.is_inference()
    ref = greedy(model, ids, mask, 10)
    runs = []
    for t, h in ((model, head), (model_inf, head_inf)):
        a = spec(t, EagleHeadDrafter(t, h, 3), ids, mask, 10)
        with torch.inference_mode() if h is head_inf else torch.no_grad():
            h.layers[0].mlp.down_proj.weight.mul_(-3.0)  # drafts change (a cached stack would not see it)
        b = spec(t, EagleHeadDrafter(t, h, 3), ids, mask, 10)
        assert torch.equal(a.sequences, ref) and torch.equal(b.sequences, ref)
        runs.append((a.stats.accepted_drafts, b.stats.accepted_drafts))
    assert runs[0] == runs[1] and runs[0][0] != runs[0][1] and runs[0][0] > 0


# ---- 2. mixed dtypes -------------------------------------------------------------------------
def mixed_llama():
    """Layer 0 and the embeddings float32, layer 1, the final norm and the head float64 (the
    model itself runs: the norm's float64 weight promotes the hidden state)."""
    model = tiny_llama(2, 0, dtype=torch.float32)
    for m in (model.model.layers[1], model.model.norm, model.lm_head):
        m.to(torch.float64)
    return model


def test_mixed_dtype_model_runs_stock_kernels_and_prepack_true_is_refused():
    from mmspec.models import kernel_choice
    from mmspec.models.prepack import packable, packed_model

    model = mixed_llama()
    ids, mask = left_padded([5, 3])
    ref = spec(HFTarget(model, prepack=False), NullDrafter(V), ids, mask)
    assert torch.equal(ref.sequences, model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                                     max_new_tokens=8, pad_token_id=0, eos_token_id=None))
    target = HFTarget(model)  # "auto": measured and packed float64 layers (itensor_view_from_dense ... Double)
    assert target.kernels == "stock"
    assert torch.equal(spec(target, NullDrafter(V), ids, mask).sequences, ref.sequences)
    if prepack_available():
        with pytest.raises(ValueError, match=r"prepack=True but its linear layers mix dtypes torch.float32, "
                                             r"torch.float64 \(e\.g\. model\.layers\.1\.self_attn\.q_proj is "
                                             r"torch.float64\)"):
            HFTarget(model, prepack=True)
        # packing and the measurement take the float32 layers only, each on inputs of its dtype
        assert packable(model.model.layers[0].mlp.up_proj) and not packable(model.lm_head)
        view = packed_model(model)
        assert sum(isinstance(m, PackedLinear) for m in view.modules()) == 7  # layer 0's q k v o gate up down
        with torch.no_grad():
            assert torch.allclose(view(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)
        assert kernel_choice.measure(model, budget_s=0.05)["layers"] == 7


# ---- 3. per-wrap kernel policy ---------------------------------------------------------------
@needs_onednn
def test_two_wraps_of_one_model_keep_their_own_prepack(monkeypatch):
    """prepack=True and "auto" (measured mixed: stock at 1 row) on one model: each wrap runs and
    reports its own kernels, whichever was built last; the packed weights are shared."""
    from mmspec.models import kernel_choice
    from mmspec.models.prepack import for_rows, mixed_source, refresh

    mixed = kernel_choice.KernelPolicy(kernel_choice.ROWS, (False, True, True, True, True))
    monkeypatch.setattr(kernel_choice, "measure", lambda model, *a, **k: {"prepack": True, "policy": mixed})
    model = tiny_llama(1, 5, hidden=48, dtype=torch.float32)
    a, b = HFTarget(model, prepack=True), HFTarget(model)
    c = HFTarget(model, prepack=True)  # the reverse order: "auto" stays mixed
    va, vb = a.runner.spec.model, b.runner.spec.model
    assert a.kernels == "prepacked" and b.kernels.startswith("mixed by rows (stock at 1, prepacked at 2")
    assert va is not vb and model not in (va, vb) and c.runner.spec.model is va
    assert for_rows(va, 1) is va and mixed_source(va) is None  # True: packed at one row too
    assert for_rows(vb, 1) is model and for_rows(vb, 2) is vb and mixed_source(vb) is model
    packed_a = {id(m.weight): m._packed for m in va.modules() if isinstance(m, PackedLinear)}
    packed_b = {id(m.weight): m._packed for m in vb.modules() if isinstance(m, PackedLinear)}
    assert packed_a.keys() == packed_b.keys() and all(packed_a[k] is packed_b[k] for k in packed_a)
    model.model.layers[0].register_forward_pre_hook(lambda mod, args: None)  # views rebuilt in place ...
    assert refresh(va) is va and refresh(vb) is vb
    packed = [[m for m in v.modules() if isinstance(m, PackedLinear)] for v in (va, vb)]
    assert all(m.policy is None for m in packed[0]) and all(m.policy == mixed for m in packed[1])  # ... each its own
    packed_rows = []  # row counts that ran the packed kernel
    forward = PackedLinear.forward

    def spy(self, x):
        rows = x.numel() // self.in_features
        if self.policy is None or self.policy.use_packed(rows):
            packed_rows.append(rows)
        return forward(self, x)

    monkeypatch.setattr(PackedLinear, "forward", spy)
    ids, mask = left_padded([5])
    out = spec(a, NullDrafter(V), ids, mask, 3)
    assert out.stats.kernels.startswith("target prepacked") and 1 in packed_rows  # one-row steps packed
    packed_rows.clear()
    assert torch.equal(spec(b, NullDrafter(V), ids, mask, 3).sequences, out.sequences)
    assert packed_rows and 1 not in packed_rows  # "auto": the 5-row prefill packed, one-row steps stock


# ---- 4. MAR class labels ---------------------------------------------------------------------
def test_mar_pipeline_takes_every_integer_label_dtype():
    from mmspec.pipelines import SpeculativeMARPipeline
    from test_mar_cspd import tiny_mar, tiny_vae

    pipe = SpeculativeMARPipeline(transformer=tiny_mar(), vae=tiny_vae())
    pipe.set_progress_bar_config(disable=True)

    def run(labels):
        return pipe(labels, num_iter=2, speculative=False, output_type="latent",
                    generator=torch.Generator().manual_seed(0)).images

    ref = run([1, 3])
    for labels in [torch.tensor([1, 3], dtype=d) for d in (torch.uint8, torch.int8, torch.int16, torch.int32)] + [
            np.array([1, 3], dtype=np.uint8), np.array([1, 3], dtype=np.int16)]:
        assert torch.equal(run(labels), ref), labels.dtype
    for bad, name in ((torch.tensor([1.0, 3.0]), "torch.float32"), (np.array([1.0, 3.0]), "torch.float64"),
                      (torch.tensor([True, False]), "torch.bool"), ([1.5, 3.0], "torch.float32")):
        with pytest.raises(ValueError, match=f"class_labels must be integer class ids, got dtype {name}"):
            run(bad)
    with pytest.raises(ValueError, match="class_labels is on the 'meta' device"):
        run(torch.empty(2, dtype=torch.long, device="meta"))


# ---- 5. meta and cross-device inputs ---------------------------------------------------------
def test_meta_and_cross_device_inputs_are_refused_by_name():
    from mmspec.engine import check_same_device

    model = tiny_llama()
    ids, mask = left_padded([4, 3])

    def run(ids, mask=None, **inputs):
        return mmspec.speculative_generate(model, NullDrafter(V), ids, mask, temperature=0, max_new_tokens=2,
                                           **inputs)

    with pytest.raises(ValueError, match="input_ids is on the 'meta' device"):
        run(torch.empty(2, 3, dtype=torch.long, device="meta"))
    with pytest.raises(ValueError, match="attention_mask is on the 'meta' device"):
        run(ids, mask.to("meta"))
    with pytest.raises(ValueError, match="pixel_values is on the 'meta' device"):
        run(ids, mask, pixel_values=torch.empty(2, 3, 8, 8, device="meta"))
    with pytest.raises(ValueError, match=r"attention_mask is on cpu but input_ids is on meta; move them to one "
                                         r"device .*attention_mask.to\(input_ids.device\)"):
        check_same_device("attention_mask", mask, ids.to("meta"))
    assert torch.equal(run(ids, mask).sequences, run(ids, mask.bool()).sequences)  # real inputs still run


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_inputs_on_another_device_than_input_ids_are_refused():
    model = tiny_llama().cuda()
    ids, mask = left_padded([4, 3])
    with pytest.raises(ValueError, match="attention_mask is on cpu but input_ids is on cuda:0"):
        mmspec.speculative_generate(model, NullDrafter(V), ids.cuda(), mask, temperature=0, max_new_tokens=2)


# ---- 6. torch dtypes -------------------------------------------------------------------------
def test_check_dtype_refuses_dtypes_the_models_do_not_compute_in():
    from mmspec.devices import check_dtype

    for ok in (None, torch.float16, torch.bfloat16, torch.float32, torch.float64):
        check_dtype(ok)
    for bad in (torch.float8_e4m3fn, torch.int64, torch.uint8, torch.bool, torch.complex64):
        with pytest.raises(ValueError, match=f"torch_dtype={bad} is not a dtype the models compute in; use "
                                             "torch.float16, torch.bfloat16, torch.float32 or torch.float64"):
            check_dtype(bad)
    from mmspec.pipelines import SpeculativeMARPipeline

    with pytest.raises(ValueError, match="torch_dtype=torch.float8_e4m3fn is not a dtype"):
        SpeculativeMARPipeline.from_pretrained("no-such-folder", torch_dtype=torch.float8_e4m3fn)


# ---- 7. Qwen2-VL grid dtype ------------------------------------------------------------------
def test_qwen2vl_float_image_grid_is_refused_by_dtype():
    from transformers import Qwen2VLForConditionalGeneration

    from conftest import tiny_qwen2vl_config
    from test_vlm_qwen2vl import GRIDS, IMG, V as QV, batch

    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(tiny_qwen2vl_config(QV, IMG)).to(torch.float64).eval()
    ids, mask, pixels, grid = batch(GRIDS[:1], [2], [3])

    def run(g):
        return mmspec.speculative_generate(model, NullDrafter(QV), ids, mask, pixel_values=pixels, image_grid_thw=g,
                                           temperature=0, max_new_tokens=3)

    assert torch.equal(run(grid.int()).sequences, run(grid).sequences)  # any integer dtype is honoured
    with pytest.raises(ValueError, match=r"image_grid_thw must be an integer tensor .* got torch.float32: pass a "
                                         r"long tensor \(e.g. image_grid_thw.long\(\)\)"):
        run(grid.float())
