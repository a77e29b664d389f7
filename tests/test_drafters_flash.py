"""FLASH drafter (drafters/flash.py) on the tiny LLaVA, float64: greedy speculative output equals
plain greedy decoding row by row (batch of 4, different prompt lengths, a row ending at EOS,
fixed and "auto" draft lengths, plain steps first); exact sampling is distributed like plain
sampling; the placeholders' features from the ragged cache equal a cache-free forward of the
head; one head forward drafts a whole chain; refusals name what they refuse."""

from __future__ import annotations

import pytest
import torch

import mmspec
from mmspec.drafters import EagleHeadConfig
from mmspec.drafters.flash import FlashDrafter, FlashHead

from _eagle_helpers import llava_test_head
from test_drafters_eagle import (ScriptedK, assert_sampled_like, greedy_rows_equal_plain,
                                 recorded_run_and_cache_free_features, sharp_llava_and_joint)
from test_vlm_llava import llava, llava_batch  # noqa: F401 (fixture)

FLASH = dict(slots=3, compress_len=2)  # the tiny LLaVA has 4 image tokens per prompt


@pytest.fixture(scope="module")
def flash_head(llava):
    model, _ = llava
    return llava_test_head(model, "flash", steps=80, **FLASH)


def counting(drafter):
    """Count the head's forwards (decode calls)."""
    calls = []
    decode = drafter.head.decode
    drafter.head.decode = lambda *a, **k: (calls.append(a[0].shape[1]), decode(*a, **k))[1]
    return calls


@pytest.mark.parametrize("K", [1, 2, 3])
def test_greedy_equals_generate(llava, flash_head, K):
    model, _ = llava
    drafter = FlashDrafter(model, flash_head, K)
    calls = counting(drafter)
    out = greedy_rows_equal_plain(model, drafter)
    assert 0 < out.stats.accepted_drafts < out.stats.drafted_nodes  # drafts kept and drafts rejected
    steps = len(out.stats.nodes_per_step)
    # One head forward per drafting step (the placeholders ride in the catch-up), plus the
    # prompt's prefill and, for K > 1, the first step's placeholders after it.
    assert len(calls) == steps + (1 if K > 1 else 0)
    del drafter.head.decode


@pytest.mark.parametrize("script", [[0, 0, 3, 0, 2, 1, 0, 3], [3, 0, 0, 1, 2]], ids=["starts-plain", "starts-drafting"])
def test_auto_draft_length_greedy_equals_generate(llava, flash_head, script):
    model, _ = llava
    drafter = FlashDrafter(model, flash_head, "auto")
    assert drafter.adaptive and drafter.max_draft_nodes == 3  # "auto" defaults to the head's slots
    drafter.controller = ScriptedK(script)
    out = greedy_rows_equal_plain(model, drafter)
    assert 0 in drafter.controller.seen and max(drafter.controller.seen) == 3
    assert out.stats.accepted_drafts > 0


@torch.no_grad()
def test_placeholder_features_equal_a_cache_free_forward(llava, flash_head):
    """The root's and the placeholders' features computed in the catch-up forward through the
    ragged cache equal the cache-free `forward_full` outputs of slots 0..2 at the root's pair."""
    model, _ = llava
    ids, mask, pixels = llava_batch([(1, 2), (4, 1), (2, 5)], seed=3)
    drafter = FlashDrafter(model, flash_head, 3)
    slots = []
    catch_up = drafter._catch_up

    def spy(roots):
        out = catch_up(roots)
        # (None where the loop held the chain to one token in the last steps: no placeholders)
        slots.append(None if drafter._slot_feats is None else drafter._slot_feats.clone())
        return out

    drafter._catch_up = spy
    rec, seq, f, src = recorded_run_and_cache_free_features(model, drafter, ids, mask, pixels)
    L = f.shape[1] // 3
    catch_ups = rec.log[1:]  # the first entry is the prompt's prefill (no placeholders recorded)
    assert len(catch_ups) == len(slots) > 2
    checked = 0
    for (rows, roots, got), placeholders in zip(catch_ups, slots):
        for j, (b, r) in enumerate(zip(rows, roots)):
            if r + 2 > seq.shape[1] - 1:  # its slots' pairs run past the decoded sequence
                continue
            where = (src[b, :L] == r - 1).nonzero().flatten()[-1]
            torch.testing.assert_close(got[j], f[b, where])
            for i in range(0 if placeholders is None else placeholders.shape[1]):
                torch.testing.assert_close(placeholders[j, i], f[b, (i + 1) * L + where])
                checked += i == 1
    assert checked >= 6  # rows whose two placeholders were both checked


def test_exact_sampling_is_distributed_like_plain(llava):
    model, ids, pixels, joint = sharp_llava_and_joint(llava)
    head = llava_test_head(model, "flash", steps=40, **FLASH)
    n = 3000
    out = mmspec.speculative_generate(model, FlashDrafter(model, head, 2), ids.expand(n, -1), acceptance="exact",
                                      temperature=1.0, top_k=4, max_new_tokens=3,
                                      pixel_values=pixels.expand(n, -1, -1, -1), generator=torch.Generator().manual_seed(13))
    assert_sampled_like(out, ids, joint, n)
    assert out.stats.row_steps > n  # several verify steps per row: rejections exercised


def test_refusals(llava, flash_head):
    model, _ = llava
    with pytest.raises(ValueError, match="drafts chains"):
        FlashDrafter(model, flash_head, tree=mmspec.TreeConfig(depth=2, top_k=2, num_nodes=4))
    with pytest.raises(ValueError, match="num_draft_tokens=4 exceeds the head's slots=3"):
        FlashDrafter(model, flash_head, 4)
    with pytest.raises(ValueError, match="max_draft_tokens=5 exceeds the head's slots=3"):
        FlashDrafter(model, flash_head, "auto", max_draft_tokens=5)
    with pytest.raises(TypeError, match="needs a FlashHead"):
        FlashDrafter(model, mmspec.drafters.EagleHead(EagleHeadConfig.for_target(model)).double())
    with pytest.raises(ValueError, match="slots must be an int >= 1"):
        EagleHeadConfig.for_target(model, kind="flash", slots=0)
    wide = FlashHead(EagleHeadConfig.for_target(model, kind="flash", slots=2, compress_len=5)).double()
    ids, mask, pixels = llava_batch([(1, 2)], seed=3)
    with pytest.raises(ValueError, match="image span of 4 tokens is shorter than the compress_len=5"):
        mmspec.speculative_generate(model, FlashDrafter(model, wide, 2), ids, mask, temperature=0, max_new_tokens=4,
                                    pixel_values=pixels, pad_token_id=0)


def test_a_flash_component_in_the_vlm_pipeline_saves_loads_and_answers_like_plain(tmp_path):
    from mmspec.pipelines import DrafterComponent, SpeculativeVLMPipeline

    from _vlm_helpers import random_images, tiny_llava_parts

    model, processor = tiny_llava_parts()
    torch.manual_seed(2)
    head = FlashHead(EagleHeadConfig.for_target(model, kind="flash", **FLASH)).double()
    pipe = SpeculativeVLMPipeline(model, processor)
    pipe.add_drafter("flash", DrafterComponent.from_head(head, "auto"))
    images = random_images(3, seed=5)
    plain = pipe(images, max_new_tokens=8, speculative=False)
    out = pipe(images, max_new_tokens=8)
    assert out.texts == plain.texts and isinstance(pipe._check_drafter(pipe.drafter), FlashDrafter)
    pipe.save_pretrained(tmp_path / "pipe")
    again = SpeculativeVLMPipeline.from_pretrained(tmp_path / "pipe", dtype=torch.float64)
    assert again.drafter.config.kind == "flash" and again(images, max_new_tokens=8).texts == plain.texts
    with pytest.raises(ValueError, match="a flash drafter drafts chains of at most its head's slots=3"):
        DrafterComponent.from_head(head, 5)
    with pytest.raises(ValueError, match="a flash drafter drafts chains"):
        DrafterComponent.from_head(head, tree=mmspec.TreeConfig(depth=2, top_k=2, num_nodes=4))


def test_flash_defaults_follow_the_heads_slots_and_a_leading_image_is_refused(llava, flash_head):
    from mmspec.pipelines import DrafterComponent
    from mmspec.pipelines.train_config import TrainDrafterConfig

    assert DrafterComponent.from_head(flash_head).config.num_draft_tokens == 3  # it was 4, then refused
    cfg = TrainDrafterConfig(pipeline="-", drafter="flash", out="-", slots=3)
    assert cfg.num_draft_tokens == 3 and cfg.ttt_steps == 0  # the unroll feeds features a FLASH head never reads
    assert TrainDrafterConfig(pipeline="-", drafter="eagle", out="-").ttt_steps == 1
    with pytest.raises(ValueError, match="a flash head never reads its own features"):
        TrainDrafterConfig(pipeline="-", drafter="flash", out="-", ttt_steps=1)
    model, _ = llava
    ids, mask, pixels = llava_batch([(0, 3)], seed=3)  # the image is the prompt's first token
    with pytest.raises(ValueError, match="a prompt begins with an image token"):
        mmspec.speculative_generate(model, FlashDrafter(model, flash_head, 2), ids, mask, temperature=0,
                                    max_new_tokens=3, pixel_values=pixels)
