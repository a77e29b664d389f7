"""Forward specs: how a model plugs into the ragged KV store, and `SpecRunner`, which drives one.

The core never calls a model directly. A model supplies a small *forward spec*:

- `embed(tokens) -> [B, Q, H]`                      token (or image-token) embedding
- `positions(logical) -> positions`                 1-D for Llama, `(3, B, Q)` M-RoPE for
                                                    Qwen2-VL, a 2-D RoPE table index for LlamaGen
- `backbone(x, positions, attention, kv, features)` the transformer over the ragged cache
- `head(hidden) -> logits`                          `lm_head`, Janus' `generation_head`, ...
- `begin(input_ids, attention_mask, model_inputs)`  per-request state (e.g. `rope_deltas`),
  `select_rows(rows)` which keeps that state in step with the batch.

`ForwardSpec.forward` composes them; a spec may override `prefill` / `forward` as a whole when
its model's own forward must run (the transformers spec does, so that every family's own
embedding scale, logit soft-capping and image merging apply exactly). `SpecRunner` owns the
`RaggedKV` store and turns (tokens, tree depth, tree visibility) into one spec forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mmspec.ragged import Attention, RaggedKV
from mmspec.types import FeatureRequest


@dataclass
class SpecOutput:
    """What one spec forward returns (before the target turns it into a `TargetOutput`)."""

    logits: torch.Tensor  # [B, Q', V] (Q' = 1 at prefill: the last prompt position)
    hidden: torch.Tensor | None = None  # [B, Q, H] final (normed) hidden state, when requested
    layers: dict[int, torch.Tensor] = field(default_factory=dict)  # layer id -> [B, Q, H]
    image_features: torch.Tensor | None = None  # [B, I, H] (prefill only), when requested
    positions: torch.Tensor | None = None  # model positions of the Q tokens, when requested


class ForwardSpec:
    """Base class of forward specs. Subclasses set `num_layers`, `vocab_size`, `dtype` and
    implement `embed`, `positions`, `backbone`, `head` (or override `forward`/`prefill`)."""

    num_layers: int
    vocab_size: int
    dtype: torch.dtype
    # False for specs whose step forward is not verified under torch.compile (`compile=` refused).
    compilable: bool = True
    # Positions a learned absolute position table can index (GPT-2's 1024); None: no such bound.
    max_positions: int | None = None
    # Tokens a request can generate at most (an image generator's token grid); None: no bound.
    max_output_tokens: int | None = None
    # Set by the runner: eager CPU step forwards may choose their attention form by measurement
    # (mmspec/cpu_attention.py); specs that support it read this flag.
    cpu_attention: bool = False

    # ---- per request -----------------------------------------------------------------------
    def begin(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, model_inputs: dict[str, Any]) -> None:
        """Start a request. Refuse (ValueError naming it) any model input the spec does not use."""
        if model_inputs:
            raise ValueError(
                f"{type(self).__name__} takes no extra model inputs, got {sorted(model_inputs)}; remove them or use "
                "a target whose spec consumes them"
            )

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep per-row state in step with the batch (default: none)."""

    # ---- the pieces --------------------------------------------------------------------------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def positions(self, logical: torch.Tensor) -> torch.Tensor:
        """logical [B, Q] (prompt-relative, padding excluded) -> what the backbone takes."""
        return logical

    def backbone(
        self, x: torch.Tensor, positions: torch.Tensor, attention: Attention, kv: RaggedKV, features: FeatureRequest
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        raise NotImplementedError

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # ---- composed forwards ---------------------------------------------------------------------
    def prefill(
        self,
        input_ids: torch.Tensor,  # [B, L]
        attention: Attention,
        kv: RaggedKV,
        model_inputs: dict[str, Any],
        features: FeatureRequest,
    ) -> SpecOutput:
        return self.forward(input_ids, attention, kv, features, last_only=True)

    def forward(
        self, tokens: torch.Tensor, attention: Attention, kv: RaggedKV, features: FeatureRequest, *, last_only=False
    ) -> SpecOutput:
        pos = self.positions(attention.q_pos)
        hidden, layers = self.backbone(self.embed(tokens), pos, attention, kv, features)
        keep = int(last_only)  # False: every query; True: the last; an int n: the last n
        logits = self.head(hidden[:, -keep:] if keep else hidden)
        return SpecOutput(
            logits=logits,
            hidden=hidden if features.last_hidden else None,
            layers=layers,
            positions=pos if features.positions else None,
        )


class SpecRunner:
    """Drives one forward spec over a `RaggedKV` store (used by targets and model drafters).

    `static=True` runs the step forwards over a `StaticKV` (mmspec/static_kv.py: buffers at the
    request's bound, whole-capacity attention, queries padded to a fixed count per forward
    kind, finished rows kept as inert padding), so that their shapes never change within a
    request; `compile` (torch.compile keywords, mmspec/compiled.py) then wraps the spec's
    step forward in `torch.compile(..., dynamic=False)`. Prefill stays eager."""

    def __init__(self, spec: ForwardSpec, *, static: bool | None = None, compile: dict[str, Any] | None = None,
                 attention: str = "auto"):
        from mmspec.attention_choice import check_mode
        from mmspec.compiled import static_and_compile

        static, compile = static_and_compile(static, compile)  # as SpecTarget takes them (True, "default", a dict)
        self.spec = spec
        # CUDA eager forwards (prefill and steps): the attention backends measured fastest on fresh
        # shapes (mmspec/attention_choice.py), resolved at prefill; None leaves torch's choice alone.
        self.attention = check_mode(attention)
        # Held by the runner and set on the spec before each forward: a spec shared by two runners
        # (one compiled, one eager) got the last-built runner's flag for both.
        self.cpu_attention = spec.cpu_attention = self.attention == "auto" and not (static or compile is not None)
        self._sdpa: list | None = None
        self.kv: RaggedKV | None = None
        self.features = FeatureRequest()
        self.static = static or compile is not None
        self.compile = compile
        self._step = spec.forward
        if compile is not None:
            if not getattr(spec, "compilable", True):
                raise ValueError(f"compile={compile!r} is not supported for {type(spec).__name__} (not verified under "
                                 "torch.compile); use static=True without compile, or no compile")
            from mmspec.compiled import compiled

            unpacked = getattr(spec, "for_compile", None)  # e.g. LlamaGenSpec: no prepacked view under compile
            if callable(unpacked):
                unpacked()
            self._step = compiled(spec.forward, compile)

    def prefill(
        self,
        input_ids: torch.Tensor,  # [B, L] left-padded
        attention_mask: torch.Tensor,  # [B, L]
        max_slots: int,
        model_inputs: dict[str, Any],
        features: FeatureRequest | None = None,
    ) -> SpecOutput:
        self.features = features if features is not None else FeatureRequest()
        if self.compile is not None and not self.features.empty:
            raise ValueError(
                f"compile={self.compile!r} cannot read drafter features {self.features} (they are captured with "
                "forward hooks, which a compiled forward does not run per call); use static=True without compile"
            )
        self.spec.begin(input_ids, attention_mask, model_inputs)
        if self.static:
            from mmspec.static_kv import StaticKV

            previous = self.kv if isinstance(self.kv, StaticKV) else None
            self.kv = StaticKV(self.spec.num_layers, attention_mask, max_slots, reuse=previous, dtype=self.spec.dtype)
        else:
            self.kv = RaggedKV(self.spec.num_layers, attention_mask, max_slots)
        attention = self.kv.plan_prefill(attention_mask)
        from mmspec.attention_choice import backends_for, context

        # None on CPU, for static shapes (plans repeat within a request) and with mode "torch"
        self._sdpa = None if self.static else backends_for(self.spec, input_ids.device, self.spec.dtype,
                                                           self.attention)
        with context(self._sdpa):  # the prompt's length is a fresh shape too
            self.spec.cpu_attention = self.cpu_attention
            out = self.spec.prefill(input_ids, attention, self.kv, model_inputs, self.features)
        self.kv.scrub_padding()
        if self.compile is not None:
            from mmspec.compiled import uses_cuda_graphs

            if uses_cuda_graphs(self.compile):
                self.kv.mark_static()
        return out

    def forward(
        self,
        tokens: torch.Tensor,  # [B, Q]
        depth: torch.Tensor,  # [B, Q] logical offset from the next committed position
        tree_visible: torch.Tensor,  # [B, Q, T+Q] bool over the uncommitted region
        uncommitted: int,  # T (host int)
        *,
        last_only: bool | int = False,  # logits of the last query only (True) or of the last n (an int)
        queries: int | None = None,  # static mode: the fixed query count of this forward kind
        sees_region: bool = False,  # the caller's fact: each new token sees the whole region (a chain step)
    ) -> SpecOutput:
        if not isinstance(last_only, bool) and (not isinstance(last_only, int) or not 1 <= last_only <= tokens.shape[1]):
            raise ValueError(f"last_only must be a bool or an int in 1..{tokens.shape[1]} (queries whose logits to keep), "
                             f"got {last_only!r}")
        self.spec.cpu_attention = self.cpu_attention
        if not self.static:
            attention = self.kv.plan(depth, tree_visible, uncommitted, sees_region=sees_region)
            if self._sdpa is not None:  # CUDA, measured (the CPU path stays free of any context)
                from mmspec.attention_choice import context

                with context(self._sdpa):
                    return self._step(tokens, attention, self.kv, self.features, last_only=last_only)
            return self._step(tokens, attention, self.kv, self.features, last_only=last_only)
        return self._static_forward(tokens, depth, tree_visible, uncommitted, last_only, queries)

    def _static_forward(self, tokens, depth, tree_visible, uncommitted, last_only, queries) -> SpecOutput:
        """Pad to the static shapes [B0, Q], run the (compiled) step, keep the active rows'
        real queries."""
        if not isinstance(last_only, bool):
            raise ValueError(f"a static forward keeps the logits of every query or of the last, got last_only={last_only!r}")
        kv = self.kv
        q = tokens.shape[1]
        Q = q if queries is None else queries
        attention = kv.plan(depth, tree_visible, uncommitted, Q)
        keep_last = last_only and q == Q  # else the last real query is not the last query
        out = self._step(kv.pad_tokens(tokens, Q), attention, kv, self.features, last_only=keep_last)
        logits = kv.unpad(out.logits, None if keep_last else q)
        if last_only and not keep_last:
            logits = logits[:, -1:]
        positions = out.positions
        if positions is not None:  # [B0, Q] or M-RoPE [3, B0, Q]
            positions = positions[:, kv.active, :q] if positions.dim() == 3 else kv.unpad(positions, q)
        return SpecOutput(
            logits=logits,
            hidden=kv.unpad(out.hidden, q),
            layers={i: kv.unpad(h, q) for i, h in out.layers.items()},
            positions=positions,
        )

    def advance(self, counts: torch.Tensor, counts_host: list[int], path: torch.Tensor | None = None) -> None:
        self.kv.advance(counts, counts_host, path)

    def select_rows(self, rows: torch.Tensor, rows_host: list[int]) -> None:
        self.kv.select_rows(rows, rows_host)
        if not self.static:  # a static store keeps every physical row (and the spec's row state)
            self.spec.select_rows(rows)
