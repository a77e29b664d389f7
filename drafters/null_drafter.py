"""`NullDrafter`: drafts nothing, so the speculative loop is plain autoregressive decoding
(one target forward per token) through the same target code. The baseline of the image
pipeline's `speculative=False` and of the benchmarks.

Limits: none; it only needs the target's vocabulary size (the loop checks it).
"""

from __future__ import annotations

import torch

from mmspec.sampling import plain_number
from mmspec.types import Draft, FeatureRequest


class NullDrafter:
    """K = 0 drafter: every step verifies the root alone (plain decoding)."""

    features = FeatureRequest()
    max_draft_nodes = 0
    draft_calls = 0

    def __init__(self, vocab_size: int):
        vocab_size = plain_number(vocab_size)
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1 (the target's vocabulary size), got {vocab_size!r}")
        self.vocab_size = vocab_size

    def prefill(self, input_ids, attention_mask, target_out, model_inputs, max_new_tokens) -> None:
        pass

    def propose(self, roots: torch.Tensor, sampling, generator) -> Draft:
        empty = roots.new_zeros(roots.shape[0], 0)
        return Draft(tokens=empty, parents=empty, is_chain=True)

    def commit(self, info, target_out) -> None:
        pass

    def select_rows(self, rows, rows_host) -> None:
        pass
