"""`FlashDrafter`: a semi-autoregressive feature head over pooled visual tokens (FLASH).

FLASH (Wang et al. 2025, "FLASH: Latent-Aware Semi-Autoregressive Speculative Decoding for
Multimodal Tasks", arXiv 2505.12728; github.com/ZihuaEvan/FlashSD) makes an EAGLE-style draft
head cheaper on image prompts in two ways:

1. **Latent-aware visual compression.** Each image span of the prompt is pooled into
   `compress_len` tokens by learned queries `A` [C, H] attending over the *target's* final
   (normed) hidden states at the image positions: `softmax(A V^T) V`, one head, no projections,
   as in the public code (hence "latent-aware": the pooling reads the target's latents, not the
   pixels' embeddings). The pooled tokens replace the span in the head's input. Here they sit at
   the span's last C positions, so later text keeps its RoPE distance to the image (the public
   code renumbers the shortened sequence instead).
2. **A semi-autoregressive head.** The head's input at the root, `x = fc(concat(e(root), h))`,
   is repeated in `slots` placeholders `x + s_i` (learned slot embeddings, `s_0 = 0`);
   placeholder i sits at position `t + i`, sees the committed prefix and placeholders 0..i of its
   own block, and predicts the target's feature `h_{t+1+i}`. One head forward therefore drafts a
   chain of up to `slots` tokens, where EAGLE runs one forward per token. The drafted tokens are
   not fed back: token i's proposal q_i does not depend on the tokens sampled before it, which
   speculative sampling allows (every draft is still sampled from the q it reports).

Trained as the EAGLE head is (pipelines/train_drafter.py: SmoothL1 on features + 0.1 soft
cross-entropy), on every slot, with the target's own answers. In mmspec the placeholders ride in
the same forward as the catch-up of the accepted tokens, so a step costs one head forward.

Not reproduced from the later public revision ("SpecFLASH"): its gated fc, the per-slot residual
gate and the Hydra refinement MLPs; the published inference loops verify slot i against the
target's prediction for the token after it, which is not lossless, and are not followed.
Limits: chains only (a tree is refused: use `EagleHeadDrafter`); at most `slots` tokens per step;
an image span shorter than `compress_len` tokens is refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmspec.sampling import SamplingConfig, plain_number, process_logits, sample_from
from mmspec.tree import chain_parents
from mmspec.types import Draft

from .eagle_head import EagleHead, EagleHeadConfig, EagleHeadDrafter
from .span_layout import compress_image_spans


class FlashHead(EagleHead):
    """EAGLE head + pooling queries over the target's image latents + slot embeddings."""
    kind = "flash"

    def __init__(self, config: EagleHeadConfig):
        super().__init__(config)
        H = config.hidden_size
        self.queries = nn.Parameter(torch.randn(config.compress_len, H) * 0.02)
        self.slot_embed = nn.Parameter(torch.randn(config.slots - 1, H) * 0.02)  # s_1 .. s_{slots-1}

    def pool(self, latents: torch.Tensor) -> torch.Tensor:
        """[n, H] target hidden states of one image span -> [compress_len, H]."""
        weights = torch.softmax(F.linear(latents, self.queries.to(latents.dtype)).transpose(0, 1), -1)  # [C, n]
        return weights @ latents

    def prepare(self, next_tokens, embeds, hidden, mask):
        """Pairs (h_t, x_{t+1}) -> head inputs, every image span pooled (module docstring). Same
        returns as `EagleHead.prepare`; no global state (None)."""
        image = self.config.image_token_id
        is_img = None if image is None else (next_tokens == image) & mask.bool()
        if is_img is not None:
            is_img[:, -1] = False  # the last pair's token is the root: generated text
        if is_img is None or not bool(is_img.any()):  # SYNC: once per request
            return super().prepare(next_tokens, embeds, hidden, mask)
        C = self.config.compress_len
        fused = self.fuse(embeds, hidden)

        def image_inputs(b, t, e):  # pairs t..e-1 read image tokens t+1..e: the target's latents there
            if e - t < C:
                raise ValueError(f"an image span of {e - t} tokens is shorter than the compress_len={C} "
                                 "tokens this FLASH head pools it into; use a head with a smaller compress_len")
            return self.pool(hidden[b, t + 1 : e + 1])

        x, positions, mask2, src = compress_image_spans(embeds, mask, is_img, image_inputs,
                                                        lambda b, t, e: fused[b, t:e])
        return x, positions, mask2, src, None

    def forward_full(self, next_tokens, embeds, hidden, mask):
        """Cache-free forward over all pairs and all slots (training and reference): outputs
        [B, slots * L', H], block i holding slot i of every pair; the "source" of slot i of pair t
        is t + i (its target is the feature after it, h_{t+1+i}), and the mask drops slots past
        the last pair and slots of image pairs (with one slot: `EagleHead.forward_full`'s mask,
        and the loss leaves image pairs out)."""
        k = self.config.slots
        if k == 1:
            return super().forward_full(next_tokens, embeds, hidden, mask)
        x, positions, mask, src, _ = self.prepare(next_tokens, embeds, hidden, mask)
        B, L, H = x.shape
        device = x.device
        X = torch.cat([x] + [x + self.slot_embed[i - 1].to(x.dtype) for i in range(1, k)], 1)
        P = torch.cat([positions + i for i in range(k)], 1)
        causal = torch.ones(L, L, dtype=torch.bool, device=device).tril()
        eye = torch.eye(L, dtype=torch.bool, device=device)
        blocks = [[causal if j == 0 else (eye if j <= i else torch.zeros_like(eye)) for j in range(k)] for i in range(k)]
        vis = torch.cat([torch.cat(row, 1) for row in blocks], 0)  # [kL, kL]
        keys = mask.bool().repeat(1, k)  # [B, kL]
        visible = (vis.unsqueeze(0) & keys.unsqueeze(1)) | torch.eye(k * L, dtype=torch.bool, device=device)
        out = self.decode(X, P, visible)
        pairs = next_tokens.shape[1]
        text = torch.ones_like(mask, dtype=torch.bool)
        if self.config.image_token_id is not None:
            text = next_tokens.gather(1, src) != self.config.image_token_id
        src_k = torch.cat([src + i for i in range(k)], 1)
        keep = (mask.bool() & text).repeat(1, k) & (src_k < pairs)
        return out, P, keep.long(), src_k.clamp_max(pairs - 1)


class FlashDrafter(EagleHeadDrafter):
    """Chains of up to `head.config.slots` tokens per step from one head forward."""

    def __init__(self, target, head: FlashHead, num_draft_tokens: int | str | None = None, tree=None,
                 max_draft_tokens: int | None = None):
        if not isinstance(head, FlashHead):
            raise TypeError(f"FlashDrafter needs a FlashHead, got {type(head).__name__}")
        slots = head.config.slots
        num_draft_tokens = slots if num_draft_tokens is None else plain_number(num_draft_tokens)
        if num_draft_tokens == "auto" and max_draft_tokens is None:
            max_draft_tokens = slots
        check_flash_chain(slots, num_draft_tokens, max_draft_tokens, tree)
        super().__init__(target, head, num_draft_tokens, None, max_draft_tokens)
        self._slot_feats = None  # [B, k - 1, H] this step's placeholder features
        self._root_input = None  # [B, 1, H] the root's head input right after the prompt's prefill

    def prefill(self, input_ids, attention_mask, target_out, model_inputs, max_new_tokens):
        if self.image_token_id is not None:  # pairs read the token after theirs: a first image token is no pair's
            first = attention_mask.long().argmax(1)
            if bool((input_ids.gather(1, first.unsqueeze(1)) == self.image_token_id).any()):  # SYNC: once per request
                raise ValueError("a prompt begins with an image token; FLASH pools an image from the latents of the "
                                 "tokens after each pair's own, so put a text or BOS token first")
        super().prefill(input_ids, attention_mask, target_out, model_inputs, max_new_tokens)

    def _prefill_head(self, roots):
        feats = super()._prefill_head(roots)
        hidden = self._prompt[2][:, -1:].to(self._dtype)
        self._root_input, self._slot_feats = self._fuse(self.embed(roots.unsqueeze(1)), hidden), None
        return feats

    def _catch_up(self, roots):
        """The accepted path's pairs and, right after each row's root, its placeholders: one forward."""
        extra = self.k - 1
        self._root_input = None
        if extra <= 0:
            self._slot_feats = None
            return super()._catch_up(roots)
        self._flush()
        B, P = self.pending_tokens.shape
        H = self.head.config.hidden_size
        rows = torch.arange(B, device=roots.device)
        last = self.pending_count - 1
        tokens = self.pending_tokens.clone()
        tokens[rows, last] = roots
        x = self._fuse(self.embed(tokens), self.pending_hidden.to(self._dtype))  # [B, P, H]
        slot_in = x[rows, last].unsqueeze(1) + self.head.slot_embed[:extra].to(x.dtype)
        x = torch.cat([x, x.new_zeros(B, extra, H)], 1)
        step = torch.arange(extra + 1, device=roots.device)
        cols = last.unsqueeze(1) + step  # root, then its placeholders (over shorter rows' spare columns)
        x = x.scatter(1, cols[:, 1:].unsqueeze(-1).expand(B, extra, H), slot_in)
        depth = torch.arange(P + extra, device=roots.device).expand(B, P + extra)
        out = self._decode_new(x, depth, None, 0, chain=True)
        self.kv.advance(self.pending_count, self.pending_host)  # the placeholders stay uncommitted
        feats = out.gather(1, cols.unsqueeze(-1).expand(B, extra + 1, H))
        self._slot_feats = feats[:, 1:]
        return feats[:, 0]

    def _propose_chain(self, feats, logits, sampling: SamplingConfig, generator) -> Draft:
        B, K = feats.shape[0], self.k
        slot_feats, self._slot_feats = self._slot_feats, None
        if K > 1 and slot_feats is None:  # right after the prompt: the placeholders after its last pair
            x = self._root_input + self.head.slot_embed[: K - 1].to(self._root_input.dtype)
            depth = torch.arange(K - 1, device=feats.device).expand(B, K - 1)
            slot_feats = self._decode_new(x, depth, None, 0, chain=True)
        self._root_input = None
        all_logits = [logits] + ([] if K == 1 else list(self.logits(slot_feats[:, : K - 1]).unbind(1)))
        noise = self._chain_noise(K, sampling, logits)
        tokens, probs = [], []
        for i, lg in enumerate(all_logits):
            if sampling.greedy:
                d = lg.argmax(-1)
            else:
                q = process_logits(lg, sampling)
                d = (q / noise[:, i]).argmax(-1) if noise is not None else sample_from(q, generator)
                probs.append(q)
            tokens.append(d)
        draft_probs = None if sampling.greedy else torch.stack(probs, 1)
        return Draft(tokens=torch.stack(tokens, 1), parents=chain_parents(B, K, feats.device), draft_probs=draft_probs)


def check_flash_chain(slots: int, num_draft_tokens, max_draft_tokens, tree) -> None:
    """A FLASH head drafts chains of at most `slots` tokens a step: refuse a tree, or a draft
    length (with "auto": its `max_draft_tokens`) beyond the slots, by name. Shared by
    `FlashDrafter` and a saved `DrafterComponent` (checked there before any weights load)."""
    if tree:
        raise ValueError("a flash drafter drafts chains (its head emits up to `slots` tokens per forward); a tree "
                         "needs one forward per level: use an EagleHeadDrafter for trees")
    name, most = (("max_draft_tokens", max_draft_tokens) if num_draft_tokens == "auto"
                  else ("num_draft_tokens", num_draft_tokens))
    if isinstance(most, int) and not isinstance(most, bool) and most > slots:
        raise ValueError(f"{name}={most} exceeds the head's slots={slots}: a flash drafter drafts chains of at most its "
                         f"head's slots={slots} tokens; pass {name} <= {slots} (or leave it out: the slots)")
