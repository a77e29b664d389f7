"""`ViSpecDrafter`: an EAGLE-2 head with a vision adaptor (ViSpec).

ViSpec (Kang et al., NeurIPS 2025, "ViSpec: Accelerating Vision-Language Models with
Vision-Aware Speculative Decoding"; github.com/KangJialiang/ViSpec) observes that a small
draft head cannot make sense of hundreds of low-density image tokens. Its head therefore:

1. compresses every image span of the prompt with `num_q` learned queries that cross-attend
   over the span's image embeddings (the target's merged image features): the first
   `num_q - 1` outputs replace the whole span in the head's input, at the span's last
   `num_q - 1` positions (positions are kept, so later text keeps its RoPE distance);
2. keeps the last output as a *global image vector* g and fuses it into every later text
   input through `img_fc = Linear(2H -> H)` on `concat(h, g)` (initialised as identity on h and
   zero on g, so an untrained adaptor is a plain EAGLE head), before EAGLE's
   `fc(concat(embed(x), .))`. Text before the first image sees g = 0.

State-dict names follow the public layout: `imadpt.{q, k_proj, v_proj, o_proj}`, `img_fc`,
plus the EAGLE head's `fc` and `layers.0`. Batched here (any number of image spans per row;
rows with different compressed lengths are left-padded); chains and dynamic trees through
`EagleHeadDrafter`. Limits: an image span shorter than `num_q - 1` tokens is refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .eagle_head import EagleHead, EagleHeadConfig, EagleHeadDrafter
from .span_layout import compress_image_spans


class ImageAdaptor(nn.Module):
    """`num_q` learned queries cross-attending over one image span ([n, H] -> [num_q, H])."""

    def __init__(self, config: EagleHeadConfig):
        super().__init__()
        H = config.hidden_size
        self.heads = config.num_attention_heads
        self.num_q = config.num_q
        self.q = nn.Parameter(torch.randn(config.num_q, H) * H ** -0.5)
        self.k_proj = nn.Linear(H, H, bias=False)
        self.v_proj = nn.Linear(H, H, bias=False)
        self.o_proj = nn.Linear(H, H, bias=False)

    def forward(self, span: torch.Tensor) -> torch.Tensor:
        """[..., n, H] -> [..., num_q, H] (leading dims: spans compressed independently)."""
        *lead, n, H = span.shape
        d = H // self.heads
        q = self.q.to(span.dtype).view(self.num_q, self.heads, d).transpose(0, 1)  # [h, num_q, d]
        k = self.k_proj(span).view(*lead, n, self.heads, d).transpose(-3, -2)  # [..., h, n, d]
        v = self.v_proj(span).view(*lead, n, self.heads, d).transpose(-3, -2)
        out = F.scaled_dot_product_attention(q.expand(*lead, -1, -1, -1), k, v)  # [..., h, num_q, d]
        return self.o_proj(out.transpose(-3, -2).reshape(*lead, self.num_q, H))


class ViSpecHead(EagleHead):
    """EAGLE head + vision adaptor + global-image fusion."""
    kind = "vispec"

    def __init__(self, config: EagleHeadConfig):
        if config.image_token_id is None:
            raise ValueError("a ViSpec head needs the target's image token id (EagleHeadConfig.image_token_id)")
        super().__init__(config)
        H = config.hidden_size
        self.imadpt = ImageAdaptor(config)
        self.img_fc = nn.Linear(2 * H, H, bias=config.fc_bias)
        with torch.no_grad():
            self.img_fc.weight.zero_()
            self.img_fc.weight[:, :H].copy_(torch.eye(H))
            if self.img_fc.bias is not None:
                self.img_fc.bias.zero_()

    def fuse(self, embeds, hidden, global_vec=None):
        """`fc(concat(embed, img_fc(concat(h, g))))`; g = 0 before the first image."""
        return self.fuse_with(embeds, hidden, self.global_term(global_vec, embeds.dtype))

    def global_term(self, global_vec, dtype) -> torch.Tensor:
        """`img_fc(concat(h, g)) = W_h h + (W_g g + b)`: the second term, [..., 1, H], fixed for a
        request (a drafter computes it once and passes it to `fuse_with` at every step)."""
        H = self.config.hidden_size
        weight, bias = self.img_fc.weight, self.img_fc.bias
        if global_vec is None:
            return (bias if bias is not None else weight.new_zeros(H)).to(dtype)
        return F.linear(global_vec.to(dtype), weight[:, H:].to(dtype), None if bias is None else bias.to(dtype))

    def fuse_with(self, embeds, hidden, term):
        H = self.config.hidden_size
        fused = F.linear(hidden.to(embeds.dtype), self.img_fc.weight[:, :H]) + term
        return self.fc(torch.cat([embeds, fused], -1))

    def prepare(self, next_tokens, embeds, hidden, mask):
        """Compress every image span of each row (see the module docstring). Returns (inputs
        [B, L', H], kept positions [B, L'], mask [B, L'], source pair index [B, L'], global [B, H])."""
        B, L, H = embeds.shape
        m = self.config.num_q - 1
        is_img = (next_tokens == self.config.image_token_id) & mask.bool()
        is_img[:, -1] = False  # the last pair's token is the root: generated text
        if B > 1:  # one row: the loop below is one pass and issues fewer operations
            fast = self._prepare_one_span(embeds, hidden, mask, is_img, m)
            if fast is not None:
                return fast
        globals_ = [torch.zeros(H, dtype=embeds.dtype, device=embeds.device) for _ in range(B)]  # g = 0 before an image

        def image_inputs(b, t, e):
            if e - t < m:
                raise ValueError(f"an image span of {e - t} tokens is shorter than the {m} tokens ViSpec keeps")
            adapted = self.imadpt(embeds[b, t:e])
            globals_[b] = adapted[-1]  # the span's global vector, fused into the text after it
            return adapted[:-1]

        def text_inputs(b, t, e):
            return self.fuse(embeds[b, t:e], hidden[b, t:e], globals_[b])

        x, positions, mask2, src = compress_image_spans(embeds, mask, is_img, image_inputs, text_inputs)
        return x, positions, mask2, src, torch.stack(globals_)

    def _prepare_one_span(self, embeds, hidden, mask, is_img, m: int):
        """`prepare` without a Python loop over rows, for the common batch (measured at batch 4
        on a 2-core EPYC VM: half the loop's time, which grows with every row): left-padded rows
        with one image span each, all of the same length (one image per prompt, same image
        size). None for any other batch (the general loop handles it). Same layout as the loop:
        the span replaced by its `m` adapted tokens, rows right-aligned."""
        B, L, H = embeds.shape
        device = embeds.device
        j = torch.arange(L, device=device)
        real = mask.bool()
        first_real = torch.where(real, j, L).amin(1)
        span_starts = (is_img & ~F.pad(is_img, (1, 0))[:, :-1]).sum(1)
        first_img = torch.where(is_img, j, L).amin(1)
        n_img = is_img.sum(1)
        # Left padding only: every position from the first real one on is real.
        left_padded = real.sum(1) == L - first_real
        facts = torch.stack([first_real, n_img, span_starts, left_padded.long()], 0).tolist()  # SYNC: once per request
        start_h, n_h, spans_h, left_h = facts
        if not all(left_h) or any(c != 1 for c in spans_h) or len(set(n_h)) != 1 or n_h[0] < m:
            return None
        n = n_h[0]
        cut = min(start_h)
        Lc = L - n + m - cut
        jc = torch.arange(cut, cut + Lc, device=device).unsqueeze(0)  # [1, Lc] uncut column index
        s = first_img.unsqueeze(1)  # [B, 1]
        start = first_real.unsqueeze(1)
        in_img = (jc >= s) & (jc < s + m)
        # Source pair of each column: text before the span as is; the span's last m pairs;
        # text after it shifted by the n - m pairs the span lost.
        src = torch.where(jc < s, jc, jc + n - m)  # [B, Lc]
        keep = jc >= start  # real entries of the compressed rows
        src = torch.where(keep, src, 0)
        spans = embeds.gather(1, (s + torch.arange(n, device=device)).unsqueeze(-1).expand(B, n, H))
        adapted = self.imadpt(spans)  # [B, num_q, H]
        g = adapted[:, -1]
        after = (jc >= s + m).unsqueeze(-1)  # text after the image sees g, text before g = 0
        term = torch.where(after, self.global_term(g, embeds.dtype).unsqueeze(1), self.global_term(None, embeds.dtype))
        take = src.unsqueeze(-1).expand(B, Lc, H)
        x = self.fuse_with(embeds.gather(1, take), hidden.gather(1, take), term)
        image_x = adapted[:, :-1].gather(1, (jc - s).clamp(0, m - 1).unsqueeze(-1).expand(B, Lc, H))
        x = torch.where(in_img.unsqueeze(-1), image_x, x)
        x = torch.where(keep.unsqueeze(-1), x, torch.zeros((), dtype=x.dtype, device=device))
        positions = torch.where(keep, src - start, 0)
        return x, positions, keep.long(), src, g


class ViSpecDrafter(EagleHeadDrafter):
    """`EagleHeadDrafter` with a `ViSpecHead`: the prompt's image spans are compressed at the
    first propose, and each row's global image vector is fused into every later input."""

    def __init__(self, target, head: ViSpecHead, num_draft_tokens: int | str | None = None, tree=None,
                 max_draft_tokens: int | None = None):
        if not isinstance(head, ViSpecHead):
            raise TypeError(f"ViSpecDrafter needs a ViSpecHead, got {type(head).__name__}")
        super().__init__(target, head, num_draft_tokens, tree, max_draft_tokens)
        self.global_vec: torch.Tensor | None = None  # [B, H]

    def _set_state(self, state):
        self.global_vec = state
        self._global_term = self.head.global_term(state, self._dtype).unsqueeze(1)  # [B, 1, H], once per request

    def _select_state(self, rows):
        self.global_vec = self.global_vec.index_select(0, rows)
        self._global_term = self._global_term.index_select(0, rows)

    def _fuse(self, embeds, hidden):
        return self.head.fuse_with(embeds, hidden, self._global_term)
