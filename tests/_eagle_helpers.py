"""Feature heads that agree with their target part of the time, for tests whose claim needs
accepted drafts: an untrained head almost never proposes the target's token, so greedy equality
and exact-sampling tests with it exercise the root alone (every draft rejected). The head is
distilled briefly with the library's own EAGLE / ViSpec loss (mmspec.pipelines.train_drafter.head_loss)
on the target's greedy continuations of the test's prompts."""

from __future__ import annotations

import torch

from mmspec.drafters import EagleHeadConfig
from mmspec.drafters.eagle_head import head_class


def distilled_head(model, kind: str, ids, mask, inputs: dict | None = None, *, new_tokens: int = 12,
                   steps: int = 120, seed: int = 0, lr: float = 3e-3, **config):
    """An `EagleHead` / `ViSpecHead` / `FlashHead` (float64; `config`: EagleHeadConfig fields)
    trained `steps` Adam steps on the target's features over `ids` (left-padded) extended by its
    own greedy continuation."""
    from mmspec.pipelines.train_config import TrainDrafterConfig
    from mmspec.pipelines.train_drafter import head_loss, teacher

    inputs = inputs or {}
    image_token = getattr(model.config, "image_token_id", getattr(model.config, "image_token_index", None))
    with torch.no_grad():  # (image tokens kept out of the continuation: the forward would take them for an image)
        full = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                              pad_token_id=0, eos_token_id=None,
                              suppress_tokens=None if image_token is None else [image_token], **inputs)
        full_mask = torch.cat([mask, torch.ones(ids.shape[0], full.shape[1] - ids.shape[1], dtype=mask.dtype)], 1)
        embeds, hidden, logits = teacher(model, full, full_mask, inputs)
    torch.manual_seed(seed)
    head = head_class(kind)(EagleHeadConfig.for_target(model, kind=kind, **config)).double()
    lm_head = model.get_output_embeddings()
    config = TrainDrafterConfig(pipeline="-", drafter=kind, out="-", ttt_steps=0, ce_weight=1.0)
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    for _ in range(steps):
        loss, _ = head_loss(head, lm_head, full, full_mask, embeds, hidden, logits, image_token, config)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


def llava_test_head(model, kind: str, steps: int = 60, **config):
    """A head distilled on the LLaVA batch of `test_drafters_eagle.greedy_rows_equal_plain`
    (60 steps: it drafts the target's token roughly half the time, so drafts are both accepted
    and rejected)."""
    from test_vlm_llava import llava_batch

    ids, mask, pixels = llava_batch([(1, 2), (4, 1), (2, 5), (6, 3)], seed=7)
    return distilled_head(model, kind, ids, mask, {"pixel_values": pixels}, steps=steps, **config)
