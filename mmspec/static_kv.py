"""`StaticKV`: the ragged KV store with static shapes, for `torch.compile` and CUDA graphs.

What: the same bookkeeping as `RaggedKV` (per-row lengths, valid prefix, logical positions,
rollback by not advancing, tree compaction), but every step forward of a request sees tensors
of the same shapes, so that a compiled forward (`torch.compile(..., dynamic=False)`, CUDA
graphs with `mode="reduce-overhead"`) is traced once and replayed:

- the KV buffers `[B, H, capacity, D]` are allocated once at the request's bound
  (`max_slots`, known at prefill) and never grow;
- every step forward attends over the *whole* capacity: the visibility `[B, Q, capacity]`
  hides the slots a query may not see (other rows' drafts, rejected slots, unused tail);
- the number of queries per row is padded to a fixed `Q` (the target: `max_draft_nodes + 1`;
  each drafter forward kind has its own): a padded query sees only itself and its output is
  discarded;
- writes are index-based (`keys[rows, :, slots] = k`), never a slice whose bounds change with
  the step, and `past_len` / `kv_len` are constants of the request;
- the batch never shrinks: a finished row stays as an inert padding row (it verifies a padded
  token against its own frozen prefix, and its outputs are dropped) instead of being cut out
  with `index_select`. Why: cutting rows changes B, which costs one trace (and one CUDA-graph
  capture) per batch size, up to B of them per request and past dynamo's recompile limit for
  large batches; on a GPU the extra rows of a memory-bound decode step cost little.
  `active` maps the loop's rows to the store's physical rows.

Why a separate store: the default `RaggedKV` is tuned for eager CPU decoding (key length that
follows the longest row, slice writes, growing buffers, rows cut out as they finish); static
shapes make every step pay for the whole capacity and for finished rows, which eager CPU
decoding must not pay. Static mode is opt-in (`SpecTarget(spec, static=True)`,
`HFTarget(model, static=True | compile=...)`, `ModelDrafter(..., static=True)`).

Across requests: the capacity is rounded up to a multiple of `SLOT_BUCKET` slots, so
requests of similar lengths share a trace (one trace per batch size, query count and capacity
bucket), and a runner reuses the previous request's buffers when their shapes match (CUDA
graphs need the KV buffers at fixed addresses; `mark_static`).

Limits: the prefill (prompt length varies per request) is not static; commit bookkeeping
(`advance`, tree compaction) runs eagerly outside the compiled forward; the capacity is the
request's worst case, so memory does not follow the tokens actually generated.
"""

from __future__ import annotations

import torch

from mmspec.ragged import Attention, RaggedKV

SLOT_BUCKET = 64  # capacity granularity: requests whose bounds round to the same bucket share a trace


def _fits(previous: "StaticKV", attention_mask: torch.Tensor, dtype: torch.dtype | None) -> bool:
    """Whether the previous request's buffers can take this one's keys: same device and dtype
    (the model may have been moved or cast since: a write would cast the keys silently, and
    attention then failed on mixed dtypes), and writable here (buffers made under
    torch.inference_mode cannot be written outside it)."""
    inference = torch.is_inference_mode_enabled()
    return all(t is None or (t.device == attention_mask.device and (dtype is None or t.dtype == dtype)
                             and (inference or not t.is_inference()))
               for t in previous.keys + previous.values)


class StaticKV(RaggedKV):
    """Per-row KV buffers at a fixed capacity, a fixed physical batch and index-based writes.

    The loop sees `active` rows (`[B'] long`, physical row of each loop row); every forward
    runs over all `B0` physical rows and `queries` padded queries per row."""

    def __init__(self, num_layers: int, attention_mask: torch.Tensor, max_slots: int,
                 *, reuse: "StaticKV | None" = None, dtype: torch.dtype | None = None):
        if isinstance(max_slots, bool) or not isinstance(max_slots, int) or max_slots < attention_mask.shape[1]:
            raise ValueError(
                f"static=True needs the request's slot bound up front (an int >= the prompt length "
                f"{attention_mask.shape[1]}), got max_slots={max_slots!r}"
            )
        cap = -(-max_slots // SLOT_BUCKET) * SLOT_BUCKET
        super().__init__(num_layers, attention_mask, cap, initial_slots=cap)
        B = attention_mask.shape[0]
        if reuse is not None and reuse.physical_rows == B and reuse.capacity == cap and _fits(reuse, attention_mask,
                                                                                            dtype):
            # Same shapes as the previous request: keep its buffers (their addresses, for CUDA
            # graphs). Stale slots are never visible; prefill overwrites the prompt slots.
            self.keys, self.values = reuse.keys, reuse.values
        self.active = torch.arange(B, device=attention_mask.device)  # [B'] physical row of each loop row
        self.active_host = list(range(B))
        self.live = torch.ones(B, dtype=torch.bool, device=attention_mask.device)  # [B0] False: an inert row

    def mark_static(self) -> None:
        """Tell dynamo the KV buffers keep their addresses (CUDA graphs write them in place)."""
        for t in self.keys + self.values:
            if t is not None:
                torch._dynamo.mark_static_address(t)

    @property
    def batch_size(self) -> int:
        return len(self.active_host)

    @property
    def physical_rows(self) -> int:
        return self.length.shape[0]

    # ---- padding between the loop's rows / queries and the static shapes --------------------
    def pad_tokens(self, tokens: torch.Tensor, queries: int) -> torch.Tensor:
        """tokens [B', Q'] of the active rows -> [B0, queries] (padding: token 0)."""
        B0 = self.physical_rows
        out = tokens.new_zeros(B0, queries)
        out[self.active, : tokens.shape[1]] = tokens
        return out

    def unpad(self, t: torch.Tensor | None, q: int | None) -> torch.Tensor | None:
        """[B0, Qs, ...] -> [B', q, ...]: the active rows and their real queries (q None: all)."""
        if t is None:
            return None
        t = t.index_select(0, self.active)
        return t if q is None else t[:, :q]

    # ---- planning a forward ----------------------------------------------------------------
    def plan(
        self,
        depth: torch.Tensor,  # [B', Q'] logical offset of each new token from `next_pos`
        tree_visible: torch.Tensor,  # [B', Q', T+Q'] bool over the uncommitted region
        uncommitted: int,  # T (host int)
        queries: int | None = None,  # static Q >= Q' (None: Q')
    ) -> Attention:
        Bq, Qr = depth.shape
        Q = Qr if queries is None else queries
        if Q < Qr:
            raise ValueError(f"a static forward takes at most {Q} queries per row, got {Qr}")
        T = uncommitted
        B0, S = self.physical_rows, self.capacity
        device = depth.device
        R = T + Q  # region width seen by this forward
        if self.active_host and max(self.length_host[r] for r in self.active_host) + R > S:  # host copy, no sync
            raise RuntimeError(f"static KV cache overflow: a row needs more than the {S} slots allocated")
        # Padded queries (and every query of an inert row) see only themselves in the region.
        eye = torch.zeros(Q, R, dtype=torch.bool, device=device)
        eye[torch.arange(Q, device=device), T + torch.arange(Q, device=device)] = True
        region = eye.unsqueeze(0).repeat(B0, 1, 1)  # [B0, Q, R]
        region[self.active, :Qr, : T + Qr] = tree_visible
        full_depth = torch.zeros(B0, Q, dtype=torch.long, device=device)
        full_depth[self.active, :Qr] = depth
        # Region start per row: the committed length. An inert (finished) row may sit close to
        # the capacity; its region is moved back inside the buffer (it overwrites only its own
        # finished slots, whose outputs nobody reads). Active rows always fit (request bound).
        start = torch.clamp(self.length, max=S - R)  # [B0]
        slots = torch.arange(S, device=device).unsqueeze(0)  # [1, S]
        rel = slots - start.unsqueeze(1)  # [B0, S]
        committed = (rel < 0) & self.prefix_valid
        in_region = (rel >= 0) & (rel < R)
        region_vis = region.gather(2, rel.clamp(0, R - 1).unsqueeze(1).expand(B0, Q, S))
        visible = committed.unsqueeze(1) | (in_region.unsqueeze(1) & region_vis)  # [B0, Q, S]
        self.write_rows = torch.arange(B0, device=device).unsqueeze(1).expand(B0, Q)
        self.write_slots = start.unsqueeze(1) + T + torch.arange(Q, device=device).unsqueeze(0)
        # An inert row is fed at position 0: its own next position may lie past a position table's
        # end (a finished row whose capped last drafts were all accepted; GPT-2 failed on wpe).
        q_pos = torch.where(self.live.unsqueeze(1), self.next_pos.unsqueeze(1) + full_depth, 0)
        self.slot_pos[self.write_rows, self.write_slots] = q_pos
        self.write_slice = None  # index-based writes only
        self.kv_len, self.past_len = S, S - Q  # constants of the request (no per-step ints)
        return Attention(visible=visible, key_padding=None, q_pos=q_pos, slot_pos=self.slot_pos)

    def ensure_capacity(self, needed: int) -> None:
        if needed > self.capacity:
            raise RuntimeError(f"static KV cache overflow: need {needed} slots, allocated {self.capacity}")

    # ---- commit ------------------------------------------------------------------------------
    def advance(self, counts: torch.Tensor, counts_host: list[int], path: torch.Tensor | None = None) -> None:
        """`RaggedKV.advance` for the active rows (counts [B'], path [B', P]); inert rows stay."""
        rows = self.active
        length = self.length.index_select(0, rows)
        if path is not None:
            B, P = path.shape
            r = rows.unsqueeze(1).expand(B, P)
            src = length.unsqueeze(1) + path
            dst = length.unsqueeze(1) + torch.arange(P, device=path.device).unsqueeze(0)
            for keys, values in zip(self.keys, self.values):
                if keys is not None:
                    keys[r, :, dst] = keys[r, :, src]
                    values[r, :, dst] = values[r, :, src]
            self.slot_pos[r, dst] = self.slot_pos[r, src]
        self.length = self.length.index_add(0, rows, counts)
        self.next_pos = self.next_pos.index_add(0, rows, counts)
        for r, c in zip(self.active_host, counts_host):
            self.length_host[r] += c

    def select_rows(self, rows: torch.Tensor, rows_host: list[int]) -> None:
        """Keep only these loop rows; the others become inert padding rows (no copy)."""
        self.active = self.active.index_select(0, rows)
        self.active_host = [self.active_host[r] for r in rows_host]
        self.live = torch.zeros_like(self.live).index_fill_(0, self.active, True)
