"""`HFTarget`: any transformers causal LM or VLM as an `mmspec.Target`.

The model runs over a `RaggedCache` (see hf_cache.py): the prompt (with image inputs such
as `pixel_values` for LLaVA, which the model's own forward merges) is prefilled once; every
step verifies [root] + draft nodes in one forward with tree attention; commit keeps the root
and the accepted path. Models needing their own position scheme (Qwen2-VL's M-RoPE) subclass
this and override `positions`.
"""

from __future__ import annotations

from typing import Any

import torch

from mmspec.models.hf_cache import HFRunner
from mmspec.models.prepack import maybe_packed
from mmspec.tree import ancestors, depths
from mmspec.types import CommitInfo, TargetOutput


def chain_visibility(batch: int, q: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal visibility [B, Q, Q] and depth [B, Q] of a chain of Q tokens."""
    vis = torch.ones(q, q, dtype=torch.bool, device=device).tril().expand(batch, q, q)
    depth = torch.arange(q, device=device).expand(batch, q)
    return vis, depth


def text_vocab_size(model) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(config.vocab_size)


class HFTarget:
    """Wraps a `transformers.PreTrainedModel` with an LM head.

    `prepack` ("auto", True, False): run the model's linear layers on oneDNN-prepacked
    weights (float32 CPU models; see mmspec/models/prepack.py). The model is not modified."""

    def __init__(self, model, *, return_hidden: bool = False, prepack="auto"):
        import inspect

        if "image_grid_thw" in inspect.signature(model.forward).parameters:
            # Qwen2-VL-style models compute 3-D M-RoPE positions from the image grid; the 1-D
            # positions used here would be silently wrong, so refuse instead.
            raise ValueError(
                f"target {type(model).__name__} uses M-RoPE positions (image_grid_thw); it needs the Qwen2-VL adapter "
                "of the VLM pipeline, not the generic HFTarget"
            )
        self.model = model
        self.vocab_size = text_vocab_size(model)
        self.runner = HFRunner(maybe_packed(model, prepack), return_hidden=return_hidden)

    def _output(self, out) -> TargetOutput:
        hidden = out.hidden_states[-1] if self.runner.return_hidden else None
        return TargetOutput(logits=out.logits, hidden_states=hidden)

    def prefill(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        model_inputs: dict[str, Any],
        max_new_tokens: int,
        max_draft_nodes: int,
    ) -> TargetOutput:
        slots = input_ids.shape[1] + max_new_tokens + max_draft_nodes + 2
        out = self.runner.prefill(input_ids, attention_mask, slots, model_inputs)
        return self._output(out)

    def verify(self, tokens: torch.Tensor, parents: torch.Tensor | None) -> TargetOutput:
        B, Q = tokens.shape
        if parents is None:
            vis, depth = chain_visibility(B, Q, tokens.device)
        else:
            vis = ancestors(parents)
            depth = depths(vis)
        return self._output(self.runner.forward(tokens, depth, vis, 0))

    def commit(self, info: CommitInfo) -> None:
        counts = info.num_accepted + 1  # root + accepted nodes
        counts_host = [n + 1 for n in info.num_accepted_list]
        self.runner.advance(counts, counts_host, None if info.is_chain else info.path)

    def select_rows(self, rows: torch.Tensor, rows_host: list[int]) -> None:
        self.runner.select_rows(rows, rows_host)
