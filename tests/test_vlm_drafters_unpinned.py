"""Promises of the VLM drafters that mutants of session 61 showed no test pinned (their output
stays lossless, so only these checks see them): a component keeps its head's weights and its
max_draft_tokens, every drafted feature equals a cache-free forward of the head (chain steps,
tree levels 1 and 2, catch-ups after deferred plain steps), ViSpec's untrained adaptor is an
EAGLE head, a too-short image span is refused and a root with the image token's id is text, the
RoPE table regrows past its first size, and image features must match the image tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlavaForConditionalGeneration

import mmspec
from mmspec.drafters import EagleHead, EagleHeadConfig, EagleHeadDrafter, ViSpecHead
from mmspec.pipelines.vlm_drafter import DrafterComponent

from conftest import left_padded, tiny_llama, tiny_llava_config


def _llava():
    torch.manual_seed(0)
    return LlavaForConditionalGeneration(tiny_llava_config(64, 60)).double().eval()


def test_a_component_keeps_its_heads_weights_and_max_draft_tokens(tmp_path):
    model = _llava()
    head = EagleHead(EagleHeadConfig.for_target(model)).double()
    with torch.no_grad():
        for p in head.parameters():
            p.add_(1.0)  # "trained": unlike any fresh initialisation
    DrafterComponent.from_head(head).save_pretrained(tmp_path / "c")
    again = DrafterComponent.from_pretrained(tmp_path / "c")
    for k, v in head.state_dict().items():
        assert torch.allclose(again.head.state_dict()[k].double(), v, atol=1e-6), k
    auto = DrafterComponent(kind="eagle", head_config=dataclasses.asdict(head.config), num_draft_tokens="auto",
                            max_draft_tokens=3)
    assert auto.build(model).max_draft_nodes == 3


def _recorded_run(target, head, tree):
    drafter = EagleHeadDrafter(target, head, None if tree else 4, tree=tree)
    rec = {"steps": []}
    prefill, forward = drafter._prefill_head, drafter._forward

    def recording_prefill(roots):
        out = prefill(roots)
        rec.setdefault("root", (roots, out, drafter._prompt))
        return out

    def recording_forward(tokens, hidden, depth, vis, unc, chain=False):
        out = forward(tokens, hidden, depth, vis, unc, chain)
        if "root" in rec and len(rec["steps"]) < (3 if tree is None else 2):
            rec["steps"].append((tokens, hidden, out))
        return out

    drafter._prefill_head, drafter._forward = recording_prefill, recording_forward
    ids, mask = left_padded([7, 5])
    mmspec.speculative_generate(target, drafter, ids, mask, temperature=0, max_new_tokens=12)
    return drafter, rec


@torch.no_grad()
def test_drafted_chain_features_equal_a_cache_free_forward():
    target = tiny_llama(layers=2, seed=0)
    torch.manual_seed(0)
    head = EagleHead(EagleHeadConfig.for_target(target)).double().eval()
    drafter, rec = _recorded_run(target, head, None)
    roots, _, (p_ids, p_mask, p_hidden, _) = rec["root"]
    B, L = p_ids.shape
    toks = torch.stack([s[0][:, 0] for s in rec["steps"]], 1)
    hid = torch.stack([s[1][:, 0] for s in rec["steps"]], 1)
    nt = torch.cat([p_ids[:, 1:], roots[:, None], toks], 1)
    f, *_ = head.forward_full(nt, drafter.embed(nt), torch.cat([p_hidden.to(hid.dtype), hid], 1),
                              torch.cat([p_mask, torch.ones(B, toks.shape[1], dtype=p_mask.dtype)], 1))
    assert len(rec["steps"]) == 3
    for i, (_, _, out) in enumerate(rec["steps"]):  # (f_root, d1) -> f1, (f1, d2) -> f2, ...
        assert torch.allclose(f[:, L + i], out[:, -1], atol=1e-9)


@torch.no_grad()
def test_drafted_tree_features_equal_a_cache_free_forward_at_levels_one_and_two():
    target = tiny_llama(layers=2, seed=0)
    torch.manual_seed(0)
    head = EagleHead(EagleHeadConfig.for_target(target)).double().eval()
    drafter, rec = _recorded_run(target, head, mmspec.TreeConfig(depth=3, top_k=2, num_nodes=6))
    roots, _, (p_ids, p_mask, p_hidden, _) = rec["root"]
    B = p_ids.shape[0]
    (t1, h1, o1), (t2, h2, o2) = rec["steps"][:2]

    def cache_free(path_tokens, path_hidden):
        nt = torch.cat([p_ids[:, 1:], roots[:, None], path_tokens], 1)
        m = torch.cat([p_mask, torch.ones(B, path_tokens.shape[1], dtype=p_mask.dtype)], 1)
        f, *_ = head.forward_full(nt, drafter.embed(nt), torch.cat([p_hidden.to(path_hidden.dtype), path_hidden], 1), m)
        return f[:, -1]

    for j in range(t1.shape[1]):  # level 1: each child of the root, read with the root's feature
        assert torch.allclose(cache_free(t1[:, j:j + 1], h1[:, j:j + 1]), o1[:, j], atol=1e-9)
    for j in range(t2.shape[1]):  # level 2: a node's path is its level-1 parent, then itself
        parent = next(p for p in range(t1.shape[1]) if torch.equal(h2[:, j], o1[:, p]))
        path_t = torch.cat([t1[:, parent:parent + 1], t2[:, j:j + 1]], 1)
        path_h = torch.cat([h1[:, parent:parent + 1], h2[:, j:j + 1]], 1)
        assert torch.allclose(cache_free(path_t, path_h), o2[:, j], atol=1e-9)


@torch.no_grad()
def test_catch_up_root_features_after_deferred_plain_steps_equal_a_cache_free_forward():
    from test_drafters_eagle import ScriptedK
    from test_vlm_llava import llava_batch

    model = _llava()
    ids, mask, pixels = llava_batch([(1, 2), (4, 1), (2, 5)], seed=3)
    torch.manual_seed(0)
    head = EagleHead(EagleHeadConfig.for_target(model)).double().eval()
    L = ids.shape[1]
    drafter = EagleHeadDrafter(model, head, "auto", max_draft_tokens=3)
    drafter.controller = ScriptedK([0, 0, 3, 0, 3, 3])
    log, written = [], [1] * ids.shape[0]
    catch, commit = drafter._catch_up, drafter.commit

    def recording_catch(roots):
        f = catch(roots)
        log.append(([L + w - 1 for w in written], f.clone()))
        return f

    def counting_commit(info, out):
        for r, a in enumerate(info.num_accepted_list):
            written[r] += a + 1
        return commit(info, out)

    drafter._catch_up, drafter.commit = recording_catch, counting_commit
    seq = mmspec.speculative_generate(model, drafter, ids, mask, temperature=0, max_new_tokens=9, pixel_values=pixels,
                                      eos_token_id=None).sequences
    fm = torch.cat([mask, torch.ones(seq.shape[0], seq.shape[1] - L, dtype=mask.dtype)], 1)
    hidden = model(input_ids=seq, attention_mask=fm, pixel_values=pixels, output_hidden_states=True).hidden_states[-1]
    feats = model.model.get_image_features(pixels, vision_feature_layer=-1, vision_feature_select_strategy="default")
    emb = drafter.prompt_embeds(seq, torch.cat(list(feats.pooler_output)))
    f, _, _, src = head.forward_full(seq[:, 1:], emb[:, 1:], hidden[:, :-1], fm[:, :-1])
    checked = 0
    for roots, got in log:
        for b, r in enumerate(roots):
            if r <= seq.shape[1] - 1:
                where = (src[b] == r - 1).nonzero().flatten()
                assert torch.allclose(got[b], f[b, where[-1]], atol=1e-6)
                checked += 1
    assert checked >= 6


def test_vispec_promises():
    model = _llava()
    eagle = EagleHead(EagleHeadConfig.for_target(model)).double()
    vispec = ViSpecHead(EagleHeadConfig.for_target(model, kind="vispec")).double()
    vispec.load_state_dict(eagle.state_dict(), strict=False)
    H = eagle.config.hidden_size
    e, h, g = torch.randn(3, 1, 5, H, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # an untrained adaptor is a plain EAGLE head, with or without an image vector
        for gv in (None, g[:, 0]):
            assert torch.allclose(vispec.fuse(e, h, gv), eagle.fuse(e, h), atol=1e-12)
    head = ViSpecHead(EagleHeadConfig.for_target(model, kind="vispec", num_q=6)).double().eval()
    nxt = torch.tensor([[5, 6, 60, 60, 60, 60, 7, 8, 9]])  # a 4-token image span; num_q=6 keeps 5
    emb, hid = torch.randn(2, 1, 9, H, dtype=torch.float64)
    with torch.no_grad(), pytest.raises(ValueError):
        head.prepare(nxt, emb, hid, torch.ones_like(nxt))
    head = ViSpecHead(EagleHeadConfig.for_target(model, kind="vispec")).double().eval()
    nxt = torch.tensor([[5, 60, 60, 60, 60, 7, 8, 60]])  # the last (the root) has the image token's id
    g = torch.Generator().manual_seed(1)
    emb, hid = (torch.randn(1, 8, H, generator=g, dtype=torch.float64) for _ in range(2))
    with torch.no_grad():
        x, pos, m, src, gv = head.prepare(nxt, emb, hid, torch.ones_like(nxt))
        assert int(src[0, -1]) == 7 and torch.allclose(x[0, -1], head.fuse(emb[:, 7], hid[:, 7], gv)[0])


def test_the_rope_table_regrows_past_its_first_size():
    from mmspec.drafters.eagle_head import HeadAttention

    config = EagleHeadConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                             vocab_size=64)
    for bound in (None, 256):
        attention = HeadAttention(config)
        attention._rope(torch.arange(256).view(1, -1), torch.float64)  # a table of 256 rows
        cos, _ = attention._rope(torch.tensor([[256]]), torch.float64, bound)
        assert torch.allclose(cos[0, 0, 0], torch.cat([256 * attention.inv_freq] * 2).cos())


def test_image_features_must_match_the_image_tokens():
    model = _llava()
    d = EagleHeadDrafter(model, EagleHead(EagleHeadConfig.for_target(model)).double())
    ids = torch.tensor([[5, 60, 60, 60, 60, 7]])
    H = d.head.config.hidden_size
    d.prompt_embeds(ids, torch.randn(4, H, dtype=torch.float64))
    for n in (8, 2):
        with pytest.raises(ValueError, match="image"):
            d.prompt_embeds(ids, torch.randn(n, H, dtype=torch.float64))
