"""A preallocated, per-row KV cache for transformers 5.x models, and the runner that drives
an HF model over it with explicit positions and a 4-D additive mask.

Layout (gpt-fast style; "rollback is don't advance the length"): every row owns slots
`[0, S_max)` of a `[B, H, S_max, D]` buffer per layer. Slots `[0, L)` hold the left-padded
prompt (pad slots are masked out forever); slots `[L, length[b])` hold committed tokens;
slots from `length[b]` on are the *uncommitted region*: draft tokens written by forwards
since the last commit. A forward writes its Q new tokens at `length[b] + T + j` (T = tokens
already in the uncommitted region) and its queries see the committed prefix plus whichever
uncommitted slots the caller's tree mask allows. Committing either advances the length
over a prefix of the region (chains) or first gathers the accepted path into consecutive
slots (trees, EAGLE's compaction). Rejected slots are simply overwritten later, so a
rejected draft costs no copy at all.

Positions are logical: a row's prompt tokens are numbered from 0 after its left padding
(transformers' `cumsum(attention_mask) - 1` convention), and the token in committed slot s
has position `prompt_len[b] + (s - L)`. This makes batched speculative output equal
per-row plain `generate` output.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class RaggedLayer(CacheLayerMixin):
    """One layer's buffers; writes go to the slots the owning cache planned."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: "RaggedCache"):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        S = self.owner.max_slots
        self.keys = key_states.new_zeros(B, H, S, D)
        self.values = value_states.new_zeros(B, H, S, value_states.shape[-1])
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows, slots = self.owner.write_rows, self.owner.write_slots  # [B, Q] each
        self.keys[rows, :, slots] = key_states.transpose(1, 2)
        self.values[rows, :, slots] = value_states.transpose(1, 2)
        n = self.owner.kv_len
        return self.keys[:, :, :n], self.values[:, :, :n]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.kv_len, 0

    def get_seq_length(self) -> int:
        return self.owner.kv_len

    def get_max_length(self) -> int:
        return self.owner.max_slots


class RaggedCache(Cache):
    """transformers `Cache` whose layers write at per-row slots planned by `HFRunner`."""

    def __init__(self, num_layers: int, max_slots: int):
        self.max_slots = max_slots
        self.write_rows: torch.Tensor | None = None
        self.write_slots: torch.Tensor | None = None
        self.kv_len = 0
        super().__init__(layers=[RaggedLayer(self) for _ in range(num_layers)])

    def move_slots(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slot src[b, j] to dst[b, j] in every layer (src/dst [B, P])."""
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys[rows, :, dst] = layer.keys[rows, :, src]
                layer.values[rows, :, dst] = layer.values[rows, :, src]

    def select_rows(self, rows: torch.Tensor) -> None:
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys = layer.keys.index_select(0, rows)
                layer.values = layer.values.index_select(0, rows)


def _num_layers(model) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return config.num_hidden_layers


class HFRunner:
    """Drives one HF model (causal LM or VLM) over a `RaggedCache`.

    The host keeps a copy of each row's committed length, so the key length of a forward is
    known without a device sync (it is updated from the step's one sync in `advance`)."""

    def __init__(self, model, *, return_hidden: bool = False):
        self.model = model
        self.return_hidden = return_hidden
        self.cache: RaggedCache | None = None
        self.dtype = next(model.parameters()).dtype  # the 4-D mask must match the model dtype

    # ---- prefill -------------------------------------------------------------------------
    def prefill(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_slots: int, model_inputs: dict
    ):
        """Run the left-padded prompt; returns the model output at the last position."""
        B, L = input_ids.shape
        device = input_ids.device
        self.prompt_slots = L
        self.cache = RaggedCache(_num_layers(self.model), max_slots)
        am = attention_mask.bool()
        # prefix_valid[b, s]: slot s may be attended once committed (False on prompt pads).
        self.prefix_valid = torch.ones(B, max_slots, dtype=torch.bool, device=device)
        self.prefix_valid[:, :L] = am
        self.length = torch.full((B,), L, dtype=torch.long, device=device)
        self.length_host = [L] * B
        prompt_len = am.long().sum(1)
        self.next_pos = prompt_len.clone()  # logical position of the slot `length`
        positions = (am.long().cumsum(1) - 1).clamp_min(0)
        causal = torch.ones(L, L, dtype=torch.bool, device=device).tril()
        visible = causal.unsqueeze(0) & am.unsqueeze(1)  # [B, L, L]
        # A pad query sees nothing under the key mask; let it see itself so softmax stays finite.
        visible = visible | torch.eye(L, dtype=torch.bool, device=device).unsqueeze(0)
        self.cache.write_rows = torch.arange(B, device=device).unsqueeze(1).expand(B, L)
        self.cache.write_slots = torch.arange(L, device=device).unsqueeze(0).expand(B, L)
        self.cache.kv_len = L
        out = self._call(input_ids, visible, positions, model_inputs, logits_to_keep=1)
        return out

    # ---- forward over new tokens -----------------------------------------------------------
    def forward(
        self,
        tokens: torch.Tensor,  # [B, Q]
        depth: torch.Tensor,  # [B, Q] position offset from `next_pos`
        tree_visible: torch.Tensor,  # [B, Q, T+Q] bool over the uncommitted region
        uncommitted: int,  # T: tokens already in the uncommitted region (host int)
        *,
        logits_to_keep: int = 0,
    ):
        B, Q = tokens.shape
        device = tokens.device
        T = uncommitted
        max_len = max(self.length_host) if self.length_host else 0
        kv_len = max_len + T + Q
        if kv_len > self.cache.max_slots:
            raise RuntimeError(f"KV cache overflow: need {kv_len} slots, have {self.cache.max_slots}")
        slots = torch.arange(kv_len, device=device).unsqueeze(0)  # [1, S]
        rel = slots - self.length.unsqueeze(1)  # [B, S] offset into the uncommitted region
        committed = (rel < 0) & self.prefix_valid[:, :kv_len]  # [B, S]
        in_region = (rel >= 0) & (rel < T + Q)
        region_vis = tree_visible.gather(2, rel.clamp(0, T + Q - 1).unsqueeze(1).expand(B, Q, kv_len))
        visible = committed.unsqueeze(1) | (in_region.unsqueeze(1) & region_vis)  # [B, Q, S]
        self.cache.write_rows = torch.arange(B, device=device).unsqueeze(1).expand(B, Q)
        self.cache.write_slots = self.length.unsqueeze(1) + T + torch.arange(Q, device=device).unsqueeze(0)
        self.cache.kv_len = kv_len
        positions = self.next_pos.unsqueeze(1) + depth
        return self._call(tokens, visible, positions, {}, logits_to_keep=logits_to_keep)

    def _call(self, input_ids, visible, positions, model_inputs, *, logits_to_keep):
        neg = torch.finfo(self.dtype).min
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=visible.device).masked_fill(~visible, neg)
        return self.model(
            input_ids=input_ids,
            attention_mask=mask.unsqueeze(1),
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=self.return_hidden,
            logits_to_keep=logits_to_keep,
            **model_inputs,
        )

    # ---- commit ----------------------------------------------------------------------------
    def advance(self, counts: torch.Tensor, counts_host: list[int], path: torch.Tensor | None = None) -> None:
        """Make `counts[b]` tokens of the uncommitted region part of the committed prefix.
        With `path` [B, P] (region offsets of the kept tokens, in order) they are first
        gathered into consecutive slots; without it the region's first tokens are kept."""
        if path is not None:
            B, P = path.shape
            rows = torch.arange(B, device=path.device).unsqueeze(1).expand(B, P)
            src = self.length.unsqueeze(1) + path
            dst = self.length.unsqueeze(1) + torch.arange(P, device=path.device).unsqueeze(0)
            self.cache.move_slots(rows, src, dst)
        self.length = self.length + counts
        self.next_pos = self.next_pos + counts
        self.length_host = [a + c for a, c in zip(self.length_host, counts_host)]

    def select_rows(self, rows: torch.Tensor, rows_host: list[int]) -> None:
        self.cache.select_rows(rows)
        self.prefix_valid = self.prefix_valid.index_select(0, rows)
        self.length = self.length.index_select(0, rows)
        self.next_pos = self.next_pos.index_select(0, rows)
        self.length_host = [self.length_host[r] for r in rows_host]
