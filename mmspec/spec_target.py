"""`SpecTarget`: any forward spec as an `mmspec.Target`.

The prompt is prefilled once into the spec's ragged cache; every step verifies [root] +
draft nodes in one forward with tree attention (chains: causal); commit keeps the root and
the accepted path (trees are compacted). transformers models get `mmspec.models.HFTarget`
(this class over `HFSpec`); mmspec's own models (LlamaGen) pass their own spec.
"""

from __future__ import annotations

from typing import Any

import torch

from mmspec.sampling import cached_arange, shared_tensor
from mmspec.spec import ForwardSpec, SpecOutput, SpecRunner
from mmspec.tree import ancestors, depths
from mmspec.types import CommitInfo, FeatureRequest, TargetOutput


def chain_visibility(batch: int, q: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal visibility [B, Q, Q] and depth [B, Q] of a chain of Q tokens."""
    tri = shared_tensor(("causal", q, torch.device(device)),
                        lambda: torch.ones(q, q, dtype=torch.bool, device=device).tril())
    return tri.expand(batch, q, q), cached_arange(0, q, 1, device).expand(batch, q)  # shared: read only


def tree_visibility(parents: torch.Tensor | None, batch: int, q: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Visibility [B, Q, Q] and depth [B, Q] of [root] + nodes (parents None = chain)."""
    if parents is None:
        return chain_visibility(batch, q, device)
    vis = ancestors(parents)
    return vis, depths(vis)


def as_target_output(out: SpecOutput) -> TargetOutput:
    return TargetOutput(
        logits=out.logits,
        hidden_states=out.hidden,
        layer_states=out.layers,
        image_features=out.image_features,
        positions=out.positions,
    )


class SpecTarget:
    """A `Target` over a `ForwardSpec` and the ragged cache.

    `static=True`: every verify forward of a request has the same shapes (mmspec/static_kv.py:
    KV buffers at the request's bound, attention over the whole capacity, `max_draft_nodes + 1`
    queries per row, finished rows kept as inert padding rows). `compile` (None, True, a mode
    such as "reduce-overhead", or a dict of torch.compile keywords such as
    `{"backend": "aot_eager"}`; mmspec/compiled.py) wraps the verify forward in
    `torch.compile(..., dynamic=False)` and turns static on. Both are opt-in GPU paths: on CPU
    they make every step pay for the whole capacity.

    `attention` ("auto" or "torch"): on CUDA, "auto" runs the eager step forwards under the
    attention backends measured fastest on fresh shapes (mmspec/attention_choice.py: cuDNN
    attention builds a plan per shape, and nearly every verify has a new one); "torch" leaves
    torch's backend choice alone. On CPU, "torch" also turns off mmspec's own CPU attention
    choice (mmspec/cpu_attention.py)."""

    supports_features = True

    def __init__(self, spec: ForwardSpec, *, static: bool | None = None, compile: Any = None, attention: str = "auto"):
        from mmspec.compiled import static_and_compile

        if not isinstance(spec, ForwardSpec):
            hint = ("; for a transformers model use mmspec.models.hf_target.HFTarget(model, static=..., compile=...)"
                    if hasattr(spec, "config") and callable(spec) else "")
            raise TypeError(f"SpecTarget takes an mmspec ForwardSpec, got {type(spec).__name__}{hint}")
        self.spec = spec
        self.vocab_size = spec.vocab_size
        self.max_positions = spec.max_positions
        self.max_output_tokens = spec.max_output_tokens
        self.static, options = static_and_compile(static, compile)
        self.runner = SpecRunner(spec, static=self.static, compile=options, attention=attention)
        self.queries: int | None = None  # static: the fixed verify query count of the request

    def prefill(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        model_inputs: dict[str, Any],
        max_new_tokens: int,
        max_draft_nodes: int,
        features: FeatureRequest = FeatureRequest(),
    ) -> TargetOutput:
        if self.static:
            if isinstance(max_draft_nodes, bool) or not isinstance(max_draft_nodes, int) or max_draft_nodes < 0:
                raise ValueError(f"static=True sizes every verify at max_draft_nodes + 1 queries; the drafter must "
                                 f"declare max_draft_nodes as an int >= 0, got {max_draft_nodes!r}")
            self.queries = max_draft_nodes + 1
        slots = input_ids.shape[1] + max_new_tokens + max_draft_nodes + 2
        return as_target_output(self.runner.prefill(input_ids, attention_mask, slots, model_inputs, features))

    def check_inputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, model_inputs: dict[str, Any]) -> None:
        """Refuse model inputs the spec does not use, as `prefill` would (no forward)."""
        self.spec.begin(input_ids, attention_mask, model_inputs)

    def verify(self, tokens: torch.Tensor, parents: torch.Tensor | None) -> TargetOutput:
        B, Q = tokens.shape
        vis, depth = tree_visibility(parents, B, Q, tokens.device)
        return as_target_output(self.runner.forward(tokens, depth, vis, 0, queries=self.queries,
                                                    sees_region=parents is None))

    def commit(self, info: CommitInfo) -> None:
        counts = info.num_accepted + 1  # root + accepted nodes
        counts_host = [n + 1 for n in info.num_accepted_list]
        self.runner.advance(counts, counts_host, None if info.is_chain else info.path)

    def select_rows(self, rows: torch.Tensor, rows_host: list[int]) -> None:
        self.runner.select_rows(rows, rows_host)
