"""`RaggedCache`: the core's `RaggedKV` store seen through transformers' `Cache` interface.

transformers 5.x attention layers call `past_key_values.update(k, v, layer_idx)`; each
`RaggedLayer` forwards that to `RaggedKV.update`, which writes the new keys/values at the
slots the runner planned and returns the keys/values of the forward's `kv_len` slots. The
store keeps all bookkeeping (lengths, valid prefix, positions, compaction, row selection), so
the same store serves transformers models and mmspec's own modules alike.

`get_seq_length()` is the number of slots before the forward's first new token (0 at
prefill), and `get_mask_sizes()` the forward's key length, so that transformers' own mask
builders produce the right prefill mask from a 2-D attention mask (causal, sliding-window
and prefix-LM / `token_type_ids` variants included).
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from mmspec.ragged import RaggedKV


def cache_argument(module) -> str:
    """The keyword under which `module`'s forward takes the KV cache: `cache` from transformers
    5.24 on (its models still accept `past_key_values` through a deprecation shim, to be removed
    in 5.40), `past_key_values` before. Memoised per class in a plain dict (torch.compile traces
    a dict lookup; it warned about an `lru_cache` wrapper, which it bypasses)."""
    cls = type(module)
    name = _CACHE_ARGUMENT.get(cls)
    if name is None:
        try:
            params = inspect.signature(cls.forward).parameters
        except (TypeError, ValueError):
            params = {}
        name = _CACHE_ARGUMENT[cls] = "cache" if "cache" in params else "past_key_values"
    return name


_CACHE_ARGUMENT: dict[type, str] = {}


class RaggedLayer(CacheLayerMixin):
    """One layer's view of the store."""

    is_compileable = False
    is_sliding = False  # sliding windows are applied by the masks (the store keeps every slot)

    def __init__(self, store: RaggedKV, layer_idx: int):
        super().__init__()
        self.store = store
        self.layer_idx = layer_idx

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = self.store.update(self.layer_idx, key_states, value_states)
        self.keys, self.values = keys, values
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.store.kv_len, 0

    def get_seq_length(self) -> int:
        return self.store.past_len

    def get_max_length(self) -> int:
        return self.store.max_slots


class RaggedCache(Cache):
    """transformers `Cache` over a `RaggedKV` store (one per forward; the store persists)."""

    def __init__(self, store: RaggedKV):
        self.store = store
        super().__init__(layers=[RaggedLayer(store, i) for i in range(store.num_layers)])
