"""Shared-image packing for the testbed VLM's LM stages: several (prompt, answer) examples of one
scene in one training row, the image's tokens computed once.

What: with ``lm_pack = k > 1`` a training row is ``[BOS, image x n_visual, p1 a1, p2 a2, ..., pk
ak]``: k examples of the same scene, each drawn as the unpacked stage draws one (a caption with
probability ``caption_fraction``, else a question, existence questions with their share). A 4-D
additive attention mask lets each segment ``p_j a_j`` see the prefix (BOS and image) and itself,
causally, and nothing of the other segments; each segment's position ids restart where the
prefix ends. So every segment's tokens get exactly the attention, positions and hence logits
they would get alone in an unpacked row (a test checks the per-token losses against unpacked
rows to float tolerance), and the loss over a packed batch is the loss over its k x rows
examples.

Why: the image is 65 of the ~85 tokens of an unpacked row, and the LM stage's cost is its
tokens (the tower is frozen and cached): four examples per image cost ~140 tokens instead of
~340, so the same CPU minutes show the LM ~2.4 times as many captions and answers. Measured in
session 35: the bundled model (5000 unpacked steps) captioned training scenes as well as
validation scenes (77.8% of 600 training scenes, 75.8% of 2000 validation scenes): it underfits,
so more examples per minute is the lever (assets/testbed/README.md, "Session 35").

Limits: the segments of a row share their scene, so a batch of B rows covers B scenes; padding
segments' keys are masked, padding queries attend to the prefix and earlier padding only (their
outputs carry no label). Written against transformers 5.x, where a 4-D float mask passed as
``attention_mask`` reaches the attention layers unchanged.
"""

from __future__ import annotations

import random

import torch

from mmspec.testbed.vlm_eval import question_kind


def draw_example(caps, qa, rng: random.Random, caption_fraction: float, exists_fraction: float,
                 caption_prompt: str) -> tuple[str, str]:
    """One (prompt, answer) of a scene: the unpacked LM stage's draw, consuming the same random numbers."""
    if rng.random() < caption_fraction or not qa:
        prompt, answers = caption_prompt, caps
    else:
        exists = [(q, v) for q, v in qa if question_kind(q) == "exists"] if exists_fraction > 0 else []
        if exists and rng.random() < exists_fraction:  # no extra draw at 0: the sample stream stays as before
            prompt, answers = exists[rng.randrange(len(exists))]
        else:
            prompt, answers = qa[rng.randrange(len(qa))]
    return prompt, answers[rng.randrange(len(answers))]


def sample_packs(data: dict, tok, rng: random.Random, caption_fraction: float, exists_fraction: float,
                 k: int, caption_prompt: str) -> list[tuple[int, list[tuple[list, list]]]]:
    """One packed row per scene per epoch: (scene, [(prompt ids, answer ids + EOS)] x k)."""
    chosen = [(i, [draw_example(caps, qa, rng, caption_fraction, exists_fraction, caption_prompt) for _ in range(k)])
              for i, (caps, qa) in enumerate(zip(data["captions"], data["qa"]))]
    flat = [seg for _, segs in chosen for seg in segs]
    p_ids = tok([p + " :" for p, _ in flat], add_special_tokens=False)["input_ids"]
    a_ids = tok([a for _, a in flat], add_special_tokens=False)["input_ids"]
    out, n = [], 0
    for i, segs in chosen:
        out.append((i, [(p_ids[n + j], a_ids[n + j] + [tok.eos_token_id]) for j in range(len(segs))]))
        n += len(segs)
    return out


def packed_batch(rows, feats, head_ids, image_id: int, pad_id: int, n_visual: int, dtype=torch.float32):
    """Right-padded ids [B, L], a 4-D additive mask [B, 1, L, L], position ids [B, L], labels (-100 off
    the answers) and the rows' cached tower states."""
    prefix = list(head_ids) + [image_id] * n_visual
    P = len(prefix)
    seqs = [prefix + [t for p, a in segs for t in p + a] for _, segs in rows]
    L = max(len(s) for s in seqs)
    B = len(rows)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    seg = torch.full((B, L), -1, dtype=torch.long)  # -1: padding, 0: prefix, j >= 1: segment j
    pos = torch.zeros((B, L), dtype=torch.long)
    for b, ((_, segs), s) in enumerate(zip(rows, seqs)):
        ids[b, :len(s)] = torch.tensor(s)
        seg[b, :P] = 0
        pos[b, :P] = torch.arange(P)
        at = P
        for j, (p, a) in enumerate(segs, start=1):
            n = len(p) + len(a)
            seg[b, at:at + n] = j
            pos[b, at:at + n] = torch.arange(P, P + n)
            labels[b, at + len(p):at + n] = torch.tensor(a)
            at += n
        pos[b, at:] = torch.arange(P, P + L - at)
    q, k = seg.unsqueeze(2), seg.unsqueeze(1)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    allowed = causal & ((k == 0) | (q == k))  # prefix, or the query's own segment (padding: with padding)
    mask = torch.zeros((B, 1, L, L), dtype=dtype).masked_fill(~allowed.unsqueeze(1), torch.finfo(dtype).min)
    return ids, mask, pos, labels, feats[[i for i, _ in rows]].float()
