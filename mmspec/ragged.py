"""`RaggedKV`: the model-agnostic, per-row KV store every target and drafter runs over.

Layout (gpt-fast style; "rollback is don't advance the length"): every row owns slots
`[0, capacity)` of a `[B, H, capacity, D]` buffer per layer. Slots `[0, L)` hold the
left-padded prompt (pad slots are masked out forever); slots `[L, length[b])` hold committed
tokens; slots from `length[b]` on are the *uncommitted region*: tokens written by forwards
since the last commit (draft nodes, tree levels). A forward writes its Q new tokens at
`length[b] + T + j` (T = tokens already in the region) and its queries see the committed
prefix plus whichever region slots the caller's tree visibility allows. Committing either
advances the length over a prefix of the region (chains) or first gathers the accepted path
into consecutive slots (trees; EAGLE's compaction). Rejected slots are overwritten later, so
a rejected draft costs no copy at all.

Positions are *logical* and 1-D: a row's prompt tokens are numbered from 0 after its left
padding (transformers' `cumsum(attention_mask) - 1`), committed tokens continue from the
prompt length. Every slot remembers its logical position (`slot_pos`), so sliding-window
masks can be built for any forward. Model-specific position schemes (M-RoPE, 2-D RoPE tables)
are derived from these by the model's forward spec (`mmspec.spec.ForwardSpec.positions`).

Memory grows with what is generated: buffers start at the prompt plus one chunk and grow
geometrically (amortised, never per step), up to the request's bound.

The store knows nothing about any model: a spec's attention layer calls
`update(layer_idx, k, v)` and receives the keys/values of all `kv_len` slots of the current
forward, and reads the visibility from `attention()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROWTH_CHUNK = 64  # slots added at least per growth (amortised growth, ~1.5x)


@dataclass
class Attention:
    """Who may attend to whom in one forward over Q new tokens and S = kv_len slots.

    At prefill `visible` is None: the forward is plain causal attention over the prompt with
    `key_padding` marking real tokens (a spec may hand this to a fused causal kernel or to its
    model's own mask builder). Otherwise `visible[b, q, s]` is True where query q may attend
    slot s (committed prefix + the tree-visible part of the uncommitted region)."""

    visible: torch.Tensor | None  # [B, Q, S] bool, None at prefill
    key_padding: torch.Tensor | None  # [B, L] bool at prefill (True = real token), else None
    q_pos: torch.Tensor  # [B, Q] long, logical positions of the queries
    slot_pos: torch.Tensor  # [B, S] long, logical positions of every slot
    # True when every query sees every slot [0, S) (one new token per row, rows of equal
    # length, no prompt padding): a spec may then run without a mask.
    full: bool = False

    @property
    def is_prefill(self) -> bool:
        return self.visible is None

    def dense(self, sliding_window: int | None = None) -> torch.Tensor:
        """The visibility as a dense [B, Q, S] bool, optionally restricted to a sliding window
        (a query sees keys whose logical position is within `sliding_window - 1` before its
        own, transformers' convention). Rows that would see nothing (prompt padding) see
        themselves so that softmax stays finite; their outputs are never used."""
        if self.visible is None:
            B, L = self.key_padding.shape
            causal = torch.ones(L, L, dtype=torch.bool, device=self.q_pos.device).tril()
            vis = causal.unsqueeze(0) & self.key_padding.unsqueeze(1)
        else:
            vis = self.visible
        if sliding_window is not None:
            dist = self.q_pos.unsqueeze(2) - self.slot_pos.unsqueeze(1)  # [B, Q, S]
            vis = vis & (dist < sliding_window)
        if self.visible is None:
            vis = vis | torch.eye(vis.shape[1], vis.shape[2], dtype=torch.bool, device=vis.device).unsqueeze(0)
        return vis


class RaggedKV:
    """Per-row KV buffers and their bookkeeping (lengths, valid prefix, logical positions).

    The host keeps a copy of each row's committed length, so the key length of a forward is
    known without a device sync (it is updated from the step's one sync in `advance`)."""

    def __init__(
        self,
        num_layers: int,
        attention_mask: torch.Tensor,  # [B, L] 1 = real prompt token (left-padded)
        max_slots: int,  # the most slots this request can ever need
        *,
        initial_slots: int | None = None,
    ):
        B, L = attention_mask.shape
        device = attention_mask.device
        self.num_layers = num_layers
        self.prompt_slots = L
        self.unpadded = False  # set by `scrub_padding` (after prefill) when no prompt slot is padding
        self.max_slots = max_slots
        cap = min(max_slots, initial_slots if initial_slots is not None else L + GROWTH_CHUNK)
        self.capacity = max(cap, L)
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        am = attention_mask.bool()
        self.prefix_valid = torch.zeros(B, self.capacity, dtype=torch.bool, device=device)
        self.prefix_valid[:, :L] = am
        self.prefix_valid[:, L:] = True
        self.slot_pos = torch.zeros(B, self.capacity, dtype=torch.long, device=device)
        self.slot_pos[:, :L] = (am.long().cumsum(1) - 1).clamp_min(0)
        self.length = torch.full((B,), L, dtype=torch.long, device=device)
        self.length_host = [L] * B
        self.next_pos = am.long().sum(1)  # logical position of slot `length`
        # Plan of the forward in flight (set by `plan_prefill` / `plan`).
        self.write_rows: torch.Tensor | None = None  # [B, Q]
        self.write_slots: torch.Tensor | None = None  # [B, Q]
        # (start, stop) when every row writes the same consecutive slots (a host-side fact:
        # equal lengths): the keys / values are then copied into a slice, not scattered.
        self.write_slice: tuple[int, int] | None = None
        self.kv_len = 0
        self.past_len = 0  # slots before the first new token (0 at prefill)

    @property
    def batch_size(self) -> int:
        return self.length.shape[0]

    # ---- planning a forward ----------------------------------------------------------------
    def plan_prefill(self, attention_mask: torch.Tensor) -> Attention:
        B, L = attention_mask.shape
        device = attention_mask.device
        self.write_rows = torch.arange(B, device=device).unsqueeze(1).expand(B, L)
        self.write_slots = torch.arange(L, device=device).unsqueeze(0).expand(B, L)
        self.write_slice = (0, L)
        self.kv_len, self.past_len = L, 0
        q_pos = self.slot_pos[:, :L]
        return Attention(visible=None, key_padding=attention_mask.bool(), q_pos=q_pos, slot_pos=q_pos)

    def plan(
        self,
        depth: torch.Tensor,  # [B, Q] logical offset of each new token from `next_pos`
        tree_visible: torch.Tensor | None,  # [B, Q, T+Q] bool over the uncommitted region (None: a chain)
        uncommitted: int,  # T: tokens already in the uncommitted region (host int)
        *,
        sees_region: bool = False,  # host fact from the caller: the new tokens extend the region as a chain
    ) -> Attention:
        """`sees_region`: the caller's host-side fact that the new tokens form a chain after the
        whole uncommitted region (token j sees every region slot and new tokens 0..j), as in a
        chain verify, a chain drafter's next token or an EAGLE catch-up. Over rows of equal
        length without prompt padding the visibility is then a fixed triangle and every row
        writes the same slots, so the plan is a few operations instead of a gather; over other
        rows it is a comparison with each row's last visible slot (the writes stay scattered).
        `tree_visible` is not read then and may be None."""
        B, Q = depth.shape
        device = depth.device
        T = uncommitted
        max_len = max(self.length_host) if self.length_host else 0
        kv_len = max_len + T + Q
        self.ensure_capacity(kv_len)
        equal = bool(self.length_host) and min(self.length_host) == max_len
        self.write_slice = (max_len + T, max_len + T + Q) if equal else None
        if self.unpadded and equal and (sees_region or (Q == 1 and T == 0)):
            # Every row writes slots `write_slice` (equal lengths): a slice, no scatter. One
            # new token sees everything (a plain decoding step, a chain drafter's next token);
            # a chain of Q sees the committed prefix and the region plus its own causal triangle.
            self.write_rows = self.write_slots = None
            q_pos = self.next_pos.unsqueeze(1) + depth
            self.slot_pos[:, kv_len - Q: kv_len] = q_pos
            self.kv_len, self.past_len = kv_len, kv_len - Q
            full = Q == 1
            tri = torch.ones(Q, kv_len, dtype=torch.bool, device=device)
            visible = (tri if full else tri.tril(kv_len - Q)).expand(B, Q, kv_len)
            return Attention(visible=visible, key_padding=None, q_pos=q_pos, slot_pos=self.slot_pos[:, :kv_len],
                             full=full)
        slots = torch.arange(kv_len, device=device).unsqueeze(0)  # [1, S]
        if sees_region:
            # A chain over rows of different lengths (or with prompt padding): new token j of row
            # b sees its valid prefix and region up to its own slot, length[b] + T + j.
            limit = self.length.unsqueeze(1) + (T + 1) + torch.arange(Q, device=device).unsqueeze(0)  # [B, Q]
            visible = self.prefix_valid[:, :kv_len].unsqueeze(1) & (slots.unsqueeze(1) < limit.unsqueeze(2))
        else:
            rel = slots - self.length.unsqueeze(1)  # [B, S] offset into the uncommitted region
            committed = (rel < 0) & self.prefix_valid[:, :kv_len]
            in_region = (rel >= 0) & (rel < T + Q)
            region_vis = tree_visible.gather(2, rel.clamp(0, T + Q - 1).unsqueeze(1).expand(B, Q, kv_len))
            visible = committed.unsqueeze(1) | (in_region.unsqueeze(1) & region_vis)  # [B, Q, S]
        self.write_rows = torch.arange(B, device=device).unsqueeze(1).expand(B, Q)
        self.write_slots = self.length.unsqueeze(1) + T + torch.arange(Q, device=device).unsqueeze(0)
        q_pos = self.next_pos.unsqueeze(1) + depth
        self.slot_pos[self.write_rows, self.write_slots] = q_pos
        self.kv_len, self.past_len = kv_len, kv_len - Q
        return Attention(visible=visible, key_padding=None, q_pos=q_pos, slot_pos=self.slot_pos[:, :kv_len])

    def ensure_capacity(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        if needed > self.max_slots:
            raise RuntimeError(f"KV cache overflow: need {needed} slots, the request allows {self.max_slots}")
        new_cap = min(self.max_slots, max(needed, self.capacity + max(GROWTH_CHUNK, self.capacity // 2)))
        extra = new_cap - self.capacity

        def grow(t: torch.Tensor | None, dim: int, fill=0) -> torch.Tensor | None:
            if t is None:
                return None
            shape = list(t.shape)
            shape[dim] = extra
            return torch.cat([t, t.new_full(shape, fill)], dim)

        self.keys = [grow(k, 2) for k in self.keys]
        self.values = [grow(v, 2) for v in self.values]
        self.prefix_valid = grow(self.prefix_valid, 1, True)
        self.slot_pos = grow(self.slot_pos, 1)
        self.capacity = new_cap

    # ---- the attention layers' side ---------------------------------------------------------
    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the forward's new keys/values (k, v [B, H, Q, D]) at the planned slots and
        return the keys/values of slots [0, kv_len) ([B, H, S, D])."""
        if self.keys[layer_idx] is None:
            B, H, _, D = k.shape
            self.keys[layer_idx] = k.new_zeros(B, H, self.capacity, D)
            self.values[layer_idx] = v.new_zeros(B, H, self.capacity, v.shape[-1])
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self.write_slice is not None:
            a, b = self.write_slice
            keys[:, :, a:b] = k
            values[:, :, a:b] = v
        else:
            keys[self.write_rows, :, self.write_slots] = k.transpose(1, 2)
            values[self.write_rows, :, self.write_slots] = v.transpose(1, 2)
        n = self.kv_len
        return keys[:, :, :n], values[:, :, :n]

    def scrub_padding(self) -> None:
        """Zero the keys/values of prompt pad slots. They are never visible to a real query,
        but a model's prefill may leave NaN there (fully masked pad queries), and a masked
        NaN value still poisons a matmul (0 * NaN)."""
        L = self.prompt_slots
        pad = ~self.prefix_valid[:, :L]  # [B, L]
        if not bool(pad.any()):  # SYNC: once per request, after prefill
            self.unpadded = True
            return
        keep = ~pad[:, None, :, None]
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None:
                k[:, :, :L] = torch.where(keep, k[:, :, :L], torch.zeros((), dtype=k.dtype, device=k.device))
                v[:, :, :L] = torch.where(keep, v[:, :, :L], torch.zeros((), dtype=v.dtype, device=v.device))

    # ---- commit ------------------------------------------------------------------------------
    def advance(self, counts: torch.Tensor, counts_host: list[int], path: torch.Tensor | None = None) -> None:
        """Make `counts[b]` tokens of the uncommitted region part of the committed prefix.
        With `path` [B, P] (region offsets of the kept tokens, in order) they are first
        gathered into consecutive slots; without it the region's first tokens are kept."""
        if path is not None:
            B, P = path.shape
            rows = torch.arange(B, device=path.device).unsqueeze(1).expand(B, P)
            src = self.length.unsqueeze(1) + path
            dst = self.length.unsqueeze(1) + torch.arange(P, device=path.device).unsqueeze(0)
            for keys, values in zip(self.keys, self.values):
                if keys is not None:
                    keys[rows, :, dst] = keys[rows, :, src]
                    values[rows, :, dst] = values[rows, :, src]
            self.slot_pos[rows, dst] = self.slot_pos[rows, src]
        self.length = self.length + counts
        self.next_pos = self.next_pos + counts
        self.length_host = [a + c for a, c in zip(self.length_host, counts_host)]

    def select_rows(self, rows: torch.Tensor, rows_host: list[int]) -> None:
        """Keep only these batch rows ([B'] long, and the same as a host list), in order.

        The KV buffers are compacted in place (each kept row moved down to its new index, the
        buffers narrowed to the first B' rows) instead of gathered into new tensors: a gather
        allocates the whole KV store anew, and on CPU touching that fresh memory cost most of a
        step (a 71 MB store: 22.7 ms for the first gather of a request, 3.6 ms for the next).
        Rows already in place are not copied; rows only move down, so no copy overwrites a row
        still to be read."""
        if any(b <= a for a, b in zip(rows_host, rows_host[1:])):  # not in order: gather
            self.keys = [None if k is None else k.index_select(0, rows) for k in self.keys]
            self.values = [None if v is None else v.index_select(0, rows) for v in self.values]
        else:
            moves = [(j, i) for j, i in enumerate(rows_host) if i != j]
            n = len(rows_host)
            for buffers in (self.keys, self.values):
                for layer, t in enumerate(buffers):
                    if t is None:
                        continue
                    for j, i in moves:
                        t[j].copy_(t[i])
                    buffers[layer] = t[:n]
        self.prefix_valid = self.prefix_valid.index_select(0, rows)
        self.slot_pos = self.slot_pos.index_select(0, rows)
        self.length = self.length.index_select(0, rows)
        self.next_pos = self.next_pos.index_select(0, rows)
        self.length_host = [self.length_host[r] for r in rows_host]
