"""Shared-image packing of the testbed VLM's LM stages (mmspec/testbed/vlm_pack.py): a packed row
gives every example the logits it gets alone, its draws are the unpacked stage's, and the LM and
tune stages train with it."""

from __future__ import annotations

import random

import pytest
import torch

from mmspec.testbed.vlm_pack import draw_example, packed_batch, sample_packs
from mmspec.testbed.vlm_train import (CAPTION_PROMPT, VLMTrainConfig, build_model, build_processor, lm_batch,
                                      lm_loss, sample_examples)
from mmspec.testbed.world import World

CFG = VLMTrainConfig(tower_dim=32, tower_layers=1, tower_heads=2, lm_dim=32, lm_layers=2, lm_heads=2, lm_ffn=64)


def _model_and_rows(k: int, rows: int, seed: int = 0):
    torch.manual_seed(seed)
    g = random.Random(seed)
    model = build_model(CFG, 40, 3).double().eval()
    n_vis = CFG.num_visual_tokens
    feats = torch.randn(rows, n_vis, CFG.tower_dim, dtype=torch.float64)

    def ids(n):
        return [g.randrange(4, 40) for _ in range(n)]

    packs = [(r, [(ids(g.randrange(2, 6)), ids(g.randrange(1, 9)) + [2]) for _ in range(k)]) for r in range(rows)]
    return model, packs, feats


def _per_token_ce(model, ids, mask, labels, feats, pos=None):
    """The answer tokens' cross-entropies in row order (the loss lm_loss averages)."""
    image = model.model.multi_modal_projector(feats)
    embeds = model.get_input_embeddings()(ids)
    embeds = embeds.masked_scatter((ids == 3).unsqueeze(-1), image.to(embeds.dtype))
    hidden = model.model.language_model(inputs_embeds=embeds, attention_mask=mask, position_ids=pos).last_hidden_state
    logits = model.lm_head(hidden[:, :-1])
    target = labels[:, 1:]
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, ignore_index=-100, reduction="none")
    return ce[target != -100]


def test_a_packed_row_gives_each_example_its_own_unpacked_losses():
    model, packs, feats = _model_and_rows(k=4, rows=3)
    with torch.no_grad():
        ids, mask, pos, labels, f = packed_batch(packs, feats, [1], 3, 0, CFG.num_visual_tokens, torch.float64)
        packed = _per_token_ce(model, ids, mask.double(), labels, f.double(), pos)
        single = [(r, p, a) for r, segs in packs for p, a in segs]
        ids1, mask1, labels1, f1 = lm_batch(single, feats, [1], 3, 0, CFG.num_visual_tokens)
        alone = _per_token_ce(model, ids1, mask1, labels1, f1.double())
        # the packed order is row by row, segment by segment: the unpacked list's order
        assert packed.shape == alone.shape and packed.numel() == sum(len(a) for _, segs in packs for _, a in segs)
        torch.testing.assert_close(packed, alone, rtol=1e-9, atol=1e-9)
        # and lm_loss's plain mean over the packed batch is the unpacked batch's
        w = torch.tensor([], dtype=torch.long)
        _, plain_packed = lm_loss(model, ids, mask.double(), labels, f.double(), 3, 0, w, 1.0, pos)
        _, plain_alone = lm_loss(model, ids1, mask1, labels1, f1.double(), 3, 0, w, 1.0)
        torch.testing.assert_close(plain_packed, plain_alone, rtol=1e-9, atol=1e-9)
        # the mask and the restarted positions are what make it so: a plain causal row differs
        causal = torch.ones_like(ids)
        leaky = _per_token_ce(model, ids, causal, labels, f.double(), None)
        assert (leaky - alone).abs().max() > 1e-5  # far above the 1e-9 the packed row meets
        unshifted = _per_token_ce(model, ids, mask.double(), labels, f.double(), None)
        assert (unshifted - alone).abs().max() > 1e-5


def test_pack_draws_are_the_unpacked_stages_draws():
    """k = 1 packs draw exactly what the unpacked stage draws, and k > 1 packs draw each segment
    the same way (same caption / question mix), scene after scene."""
    tok = build_processor(VLMTrainConfig()).tokenizer
    scenes = World(seed=0, split="validation").sample(30)
    data = {"captions": [s.captions for s in scenes], "qa": [s.qa for s in scenes]}
    one = sample_packs(data, tok, random.Random(5), 0.5, 0.8, 1, CAPTION_PROMPT)
    ref = sample_examples(data, tok, random.Random(5), 0.5, 0.8)
    assert [(i, segs[0][0], segs[0][1]) for i, segs in one] == ref
    four = sample_packs(data, tok, random.Random(5), 0.5, 0.8, 4, CAPTION_PROMPT)
    rng = random.Random(5)
    for (i, segs), s in zip(four, scenes):
        want = [draw_example(s.captions, s.qa, rng, 0.5, 0.8, CAPTION_PROMPT) for _ in range(4)]
        got = [(tok.decode(p), tok.decode(a[:-1])) for p, a in segs]
        assert [(wp + " :", wa) for wp, wa in want] == got
        assert all(a[-1] == tok.eos_token_id for _, a in segs)


def test_packing_is_refused_below_one():
    with pytest.raises(ValueError, match="lm_pack"):
        VLMTrainConfig(lm_pack=0)


def _weights(folder):
    from safetensors.torch import load_file

    return {k: v for f in sorted((folder / "target").glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_packed_lm_and_tune_stages_train_and_the_tune_trains_only_the_asked_tower_layers(tmp_path):
    """`--lm-pack 3` runs the LM and tune stages on packed rows (finite losses, the LM trained);
    `--tune-tower-layers 1` trains the tower's last layer in the tune and nothing below it."""
    import json
    import math

    from mmspec.cli import main

    tiny = ["--n-train", "16", "--n-val", "2", "--tower-steps", "2", "--tower-layers", "2", "--lm-steps", "2",
            "--lm-layers", "1", "--lm-batch", "4", "--tune-steps", "3", "--no-progress", "--lm-pack", "3"]
    out, work = tmp_path / "vlm", tmp_path / "work"
    args = ["testbed", "train-vlm", "--out", str(out), "--work", str(work), *tiny]
    assert main([*args, "--stages", "data,tower,lm"]) == 0
    lm_log = json.loads((work / "train_log.json").read_text())["lm"]
    assert lm_log and all(math.isfinite(r["loss"]) for r in lm_log)
    assert main([*args, "--stages", "tune", "--tune-tower-layers", "1"]) == 0
    log = json.loads((work / "train_log.json").read_text())["tune"]
    assert log and all(math.isfinite(r["loss"]) for r in log)
    lm, tuned = _weights(work / "pipeline_lm"), _weights(work / "pipeline")
    last = [k for k in lm if "vision_tower" in k and "encoder.layers.1." in k]
    below = [k for k in lm if "vision_tower" in k and k not in last]
    assert last and below
    assert any(not torch.equal(lm[k], tuned[k]) for k in last)  # the asked layer trained
    assert all(torch.equal(lm[k], tuned[k]) for k in below)  # the rest of the tower did not
    assert any(not torch.equal(lm[k], tuned[k]) for k in lm if "language_model" in k)
    with pytest.raises(ValueError, match="tune_tower_layers"):
        VLMTrainConfig(tower_layers=2, tune_tower_layers=3)
