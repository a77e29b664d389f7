"""Classifier-free guidance (`GuidedTarget`) over a VLM target (tiny LLaVA, float64, four
left-padded rows with their images at different offsets).

- The image-feature drafters (EAGLE chain and tree, ViSpec, FLASH) read their image features
  per half: a VLM returns them flattened per image token, and the conditional half used to get
  the first B of them (4 of 16 here), so every such drafter was refused ("16 image tokens in
  the prompt but 4 image features"). Greedy output now equals the guided reference decoded
  without drafts (NullDrafter), token for token.
- An unconditional prompt without the image, while the unconditional half reuses the
  conditional `pixel_values`, is refused by name (transformers' own "Image features and image
  tokens do not match" before)."""

from __future__ import annotations

import pytest
import torch

import mmspec
from mmspec.drafters import EagleHeadDrafter, FlashDrafter, JacobiDrafter, ViSpecDrafter
from mmspec.drafters.null_drafter import NullDrafter
from mmspec.models import HFTarget
from mmspec.types import FeatureRequest

from _eagle_helpers import distilled_head
from test_vlm_llava import IMG, llava, llava_batch  # noqa: F401 (llava: a fixture)

N = 8


def _keep_image(ids, mask, inputs):
    """The unconditional prompt: the image kept, the text after it replaced by token 5."""
    u = ids.clone()
    for b in range(u.shape[0]):
        last = int((u[b] == IMG).nonzero().flatten()[-1])
        u[b, last + 1:] = 5
    return u, mask, inputs


@pytest.fixture(scope="module")
def batch():
    return llava_batch([(1, 2), (4, 1), (2, 5), (6, 3)], seed=7)


def test_image_feature_drafters_under_guidance_equal_the_guided_reference(llava, batch):
    model, _ = llava
    ids, mask, pixels = batch
    inputs = {"pixel_values": pixels}
    V = model.config.text_config.vocab_size

    def guided():
        return mmspec.GuidedTarget(model, 1.5, make_uncond=_keep_image)

    ref = mmspec.speculative_generate(guided(), NullDrafter(V), ids, mask, max_new_tokens=N, temperature=0, **inputs)
    # what each half hands a drafter: the conditional half's features are the plain target's
    request = FeatureRequest(last_hidden=True, image_features=True)
    plain = HFTarget(model).prefill(ids, mask, dict(inputs), N, 3, request)
    out = guided().prefill(ids, mask, dict(inputs), N, 3, request)
    assert plain.image_features.shape[0] == 16  # 4 rows x 4 image tokens
    assert torch.allclose(out.image_features, plain.image_features)
    assert torch.allclose(out.uncond.image_features, plain.image_features)  # the same images, reused
    eagle = distilled_head(model, "eagle", ids, mask, inputs, steps=40)
    vispec = distilled_head(model, "vispec", ids, mask, inputs, steps=40, num_q=3)
    flash = distilled_head(model, "flash", ids, mask, inputs, steps=40, slots=3, compress_len=2)
    drafters = {"eagle": lambda: EagleHeadDrafter(model, eagle, 3),
                "eagle tree": lambda: EagleHeadDrafter(model, eagle, tree=mmspec.TreeConfig(depth=3, top_k=2,
                                                                                            num_nodes=6)),
                "vispec": lambda: ViSpecDrafter(model, vispec, 3), "flash": lambda: FlashDrafter(model, flash),
                "jacobi": lambda: JacobiDrafter(3, vocab_size=V)}
    accepted = 0
    for name, make in drafters.items():
        out = mmspec.speculative_generate(guided(), make(), ids, mask, max_new_tokens=N, temperature=0, **inputs)
        assert torch.equal(out.sequences, ref.sequences), name
        accepted += out.stats.accepted_drafts
    assert accepted > 0  # (drafts were accepted, not only replaced)


def test_an_unconditional_prompt_without_the_image_is_refused_by_name(llava, batch):
    model, _ = llava
    ids, mask, pixels = batch
    V = model.config.text_config.vocab_size

    def drop_image(i, m, inputs):
        u = i.masked_fill(i == IMG, 5)
        return u, m, {}  # pixel_values not given for this half: the conditional ones would be reused

    for target in (mmspec.GuidedTarget(model, 1.5, make_uncond=drop_image),
                   mmspec.GuidedTarget(model, 1.5, uncond_input_ids=ids.masked_fill(ids == IMG, 5),
                                       uncond_attention_mask=mask)):
        with pytest.raises(ValueError, match=r"unconditional prompts hold \[0, 0, 0, 0\] image / video placeholder "
                                             r"tokens per row where the conditional ones hold \[4, 4, 4, 4\].*"
                                             r"reuses the conditional 'pixel_values'"):
            mmspec.speculative_generate(target, NullDrafter(V), ids, mask, max_new_tokens=2, temperature=0,
                                        pixel_values=pixels)


def test_text_only_unconditional_prompts_with_no_images(llava):
    """make_uncond may return an input as None: the unconditional half has none of it. Text-only
    unconditional prompts on LLaVA (the usual VLM CFG) then decode like a hand-written CFG loop
    over the two unpadded halves; the placeholder check still refuses None beside image tokens,
    and inputs make_uncond returns in a wrong form, or that the request lacks, are named."""
    model, _ = llava
    ids, mask, pixels = llava_batch([(2, 3), (2, 3)], seed=5)  # equal lengths: no padding in either half
    V, scale = model.config.text_config.vocab_size, 2.0
    text = ids[:, -3:]  # the unconditional prompts: the text after the image alone

    def text_only(i, m, inputs):
        return text, torch.ones_like(text), {"pixel_values": None}

    target = mmspec.GuidedTarget(model, scale, make_uncond=text_only)
    out = mmspec.speculative_generate(target, NullDrafter(V), ids, mask, max_new_tokens=N, temperature=0,
                                      pixel_values=pixels)
    cond, uncond = ids, text
    with torch.no_grad():
        for _ in range(N):  # the reference: both halves recomputed in full, guided argmax appended to both
            c = model(input_ids=cond, pixel_values=pixels).logits[:, -1]
            u = model(input_ids=uncond).logits[:, -1]
            nxt = (u + scale * (c - u)).argmax(-1, keepdim=True)
            cond, uncond = torch.cat([cond, nxt], 1), torch.cat([uncond, nxt], 1)
    assert torch.equal(out.sequences, cond)
    with torch.no_grad():  # (the guidance matters here: the conditional half alone decodes otherwise)
        alone = ids
        for _ in range(N):
            alone = torch.cat([alone, model(input_ids=alone, pixel_values=pixels).logits[:, -1:].argmax(-1)], 1)
    assert not torch.equal(alone, cond)
    eagle = distilled_head(model, "eagle", ids, mask, {"pixel_values": pixels}, steps=20)
    drafted = mmspec.speculative_generate(mmspec.GuidedTarget(model, scale, make_uncond=text_only),
                                          EagleHeadDrafter(model, eagle, 3), ids, mask, max_new_tokens=N,
                                          temperature=0, pixel_values=pixels)
    assert torch.equal(drafted.sequences, cond)

    def refuse(make, message):
        with pytest.raises(ValueError, match=message):
            mmspec.speculative_generate(mmspec.GuidedTarget(model, scale, make_uncond=make), NullDrafter(V), ids,
                                        mask, max_new_tokens=2, temperature=0, pixel_values=pixels)

    refuse(lambda i, m, inputs: (i, m, {"pixel_values": None}),
           r"returned None for 'pixel_values' \(none for the unconditional half\), but the unconditional prompts hold "
           r"\[4, 4\] image / video placeholder tokens per row")
    refuse(lambda i, m, inputs: (text, torch.ones_like(text), dict(inputs)),  # a copy of the dict: still the same tensor
           r"reuses the conditional 'pixel_values'")
    refuse(lambda i, m, inputs: (i, m, {"pixel_values": [1, 2]}), r"make_uncond returned model input 'pixel_values' "
           r"as list \(\); it must be None or a tensor \[n, 3, 16, 16\]")
    refuse(lambda i, m, inputs: (i, m, {"pixel_values": pixels, "image_sizes": torch.ones(2, 2)}),
           r"make_uncond returned model inputs \['image_sizes'\] that the conditional rows do not have")


class RecordingTarget:
    """A stand-in target that records the doubled batch GuidedTarget hands it at prefill."""

    vocab_size = 16

    def __init__(self):
        self.seen = None

    def prefill(self, input_ids, attention_mask, model_inputs, max_new_tokens, max_draft_nodes, features):
        from mmspec.types import TargetOutput

        self.seen = (input_ids, attention_mask, dict(model_inputs))
        return TargetOutput(logits=torch.zeros(input_ids.shape[0], 1, self.vocab_size))

    def verify(self, tokens, parents):
        raise AssertionError("not reached")

    def commit(self, info):
        pass

    def select_rows(self, rows, rows_host):
        pass


def test_per_token_and_per_row_inputs_follow_each_half_or_are_refused():
    """A per-prompt-token input (PaliGemma / Gemma3 `token_type_ids` [B, L]) reused for longer
    unconditional prompts was not padded with them (silently misaligned: other tokens than a
    hand-written CFG loop); None for a per-row input crashed inside the model."""
    ids = torch.tensor([[3, 4, 5], [6, 7, 8]])
    mask = torch.ones_like(ids)
    types = torch.tensor([[0, 1, 1], [0, 0, 1]])
    longer = torch.tensor([[9, 9, 3, 4, 5], [9, 9, 6, 7, 8]])

    def prefill(make_uncond):
        inner = RecordingTarget()
        mmspec.GuidedTarget(inner, 2.0, make_uncond=make_uncond).prefill(ids, mask, {"token_type_ids": types}, 4, 0)
        return inner.seen

    # the unconditional half's own [B, L'] tensor: both halves left-padded to the common length
    _, _, inputs = prefill(lambda i, m, x: (longer, torch.ones_like(longer), {"token_type_ids": torch.ones(2, 5).long()}))
    assert torch.equal(inputs["token_type_ids"], torch.cat([torch.cat([torch.zeros(2, 2).long(), types], 1),
                                                            torch.ones(2, 5).long()]))
    # the same prompts: reuse is exact
    _, _, inputs = prefill(lambda i, m, x: (i, m, x))
    assert torch.equal(inputs["token_type_ids"], torch.cat([types, types]))
    for make, message in [(lambda i, m, x: (longer, torch.ones_like(longer), x),
                           r"'token_type_ids' \[B, 3\] follows the conditional prompts token by token; the "
                           r"unconditional prompts have 5 tokens, so reusing it would misalign it"),
                          (lambda i, m, x: (i + 1, m, x), r"the unconditional prompts differ, so reusing it"),
                          (lambda i, m, x: (i, m, {"token_type_ids": None}), r"None cannot stand for it"),
                          (lambda i, m, x: (longer, torch.ones_like(longer), {"token_type_ids": types.clone()}),
                           r"must be a tensor \[2, 5\]")]:
        with pytest.raises(ValueError, match=message):
            prefill(make)
    inner = RecordingTarget()
    target = mmspec.GuidedTarget(inner, 2.0, make_uncond=lambda i, m, x: (i, m, {"rows": None}))
    with pytest.raises(ValueError, match=r"None for model input 'rows'; None .* is for per-image inputs"):
        target.prefill(ids, mask, {"rows": torch.zeros(2, 4, 4)}, 4, 0)


def test_a_per_image_input_shaped_like_the_prompts_is_not_taken_for_a_per_token_one():
    """`image_grid_thw` [B images, 3] beside 3-token prompts has the shape of `input_ids`; it is a
    per-image input by name, so the unconditional half may drop it (None) or reuse it with
    longer prompts, as for any other image input."""
    ids = torch.tensor([[3, 4, 5], [6, 7, 8]])
    grid = torch.tensor([[1, 2, 2], [1, 2, 4]])
    longer = torch.tensor([[9, 9, 3, 4, 5], [9, 9, 6, 7, 8]])
    inner = RecordingTarget()
    mmspec.GuidedTarget(inner, 2.0, make_uncond=lambda i, m, x: (longer, torch.ones_like(longer), x)).prefill(
        ids, torch.ones_like(ids), {"image_grid_thw": grid}, 4, 0)
    assert torch.equal(inner.seen[2]["image_grid_thw"], torch.cat([grid, grid]))
    inner = RecordingTarget()
    mmspec.GuidedTarget(inner, 2.0, make_uncond=lambda i, m, x: (i, m, {"image_grid_thw": None})).prefill(
        ids, torch.ones_like(ids), {"image_grid_thw": grid}, 4, 0)
    assert torch.equal(inner.seen[2]["image_grid_thw"], grid)
