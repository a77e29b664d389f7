"""The three interfaces of the speculative loop: `Target`, `Drafter`, `AcceptanceRule`.

One step of `mmspec.speculative_generate` for the B active rows is

    draft  = drafter.propose(roots, sampling, generator)      # Draft: chain or tree
    out    = target.verify(roots_and_draft, parents)          # ONE forward, [B, N+1, V] logits
    result = rule.verify(...) / tree walk                     # per-row accepted path
    target.commit(info); drafter.commit(info, out)            # roll caches back per row

Each component owns its own state (KV caches, image features, CFG halves, Jacobi windows);
the loop only moves tokens and node indices between them. How the planned families fit
(see docs/architecture.md):

- HF causal LMs / VLMs: `mmspec.models.HFTarget` (image inputs go to `prefill`).
- CFG image generators: a Target whose `verify` runs the doubled batch and returns the
  guided logits; `commit` rolls both halves back with the same path.
- Jacobi self-drafting: a Drafter that keeps the window and reads the target's logits it is
  handed in `commit` (the target drafts for itself from the previous forward).
- EAGLE/ViSpec heads: a Drafter that reads `TargetOutput.hidden_states` in `commit`.
- Continuous tokens (MAR): same loop shape, with `mmspec.acceptance.ContinuousAcceptance`
  on Gaussian parameters instead of categorical probabilities.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from mmspec.sampling import SamplingConfig
from mmspec.types import AcceptanceResult, CommitInfo, Draft, TargetOutput


@runtime_checkable
class Target(Protocol):
    """The model whose distribution the output must follow."""

    vocab_size: int

    def prefill(
        self,
        input_ids: torch.Tensor,  # [B, L] left-padded
        attention_mask: torch.Tensor,  # [B, L] 1 = real token
        model_inputs: dict[str, Any],  # pixel_values, image_grid_thw, ...
        max_new_tokens: int,
        max_draft_nodes: int,
    ) -> TargetOutput:  # logits [B, 1, V] at the last prompt position
        ...

    def verify(
        self,
        tokens: torch.Tensor,  # [B, N+1] root + draft nodes
        parents: torch.Tensor,  # [B, N] parent node of each draft node, -1 = root
    ) -> TargetOutput:  # logits [B, N+1, V]
        ...

    def commit(self, info: CommitInfo) -> None:
        """Keep root + accepted path in the cache, drop the rest (per row)."""

    def select_rows(self, rows: torch.Tensor, rows_host: list[int]) -> None:
        """Keep only these batch rows ([B'] long, and the same as a host list), in order."""


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens for every active row."""

    max_draft_nodes: int

    def prefill(
        self,
        input_ids: torch.Tensor,  # [B, L] left-padded
        attention_mask: torch.Tensor,  # [B, L]
        target_out: TargetOutput,  # the target's prefill output
        model_inputs: dict[str, Any],
        max_new_tokens: int,
    ) -> None: ...

    def propose(
        self,
        roots: torch.Tensor,  # [B] last committed token per row
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Draft: ...

    def commit(self, info: CommitInfo, target_out: TargetOutput) -> None:
        """Learn the outcome of the step (accepted path, target output) and roll back."""

    def select_rows(self, rows: torch.Tensor, rows_host: list[int]) -> None: ...


@runtime_checkable
class AcceptanceRule(Protocol):
    """A pure tensor function deciding which draft tokens to keep.

    `verify` handles a chain for the whole batch; the per-candidate pieces let the core walk
    trees sibling by sibling (ALGORITHMS.md section 1, "Trees")."""

    lossless: bool

    def verify(
        self,
        draft_tokens: torch.Tensor,  # [B, K]
        draft_probs: torch.Tensor | None,  # [B, K, V] or None (deterministic drafter)
        target_probs: torch.Tensor,  # [B, K+1, V]
        *,
        generator: torch.Generator | None = None,
    ) -> AcceptanceResult: ...

    def accept_probability(
        self, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None
    ) -> torch.Tensor:  # x [M], p [M, V], q [M, V] | None -> alpha [M]
        ...

    def residual(
        self, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None
    ) -> torch.Tensor:  # distribution [M, V] to continue with after rejecting x
        ...

    def sample(self, p: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """Draw the recovered / bonus token from p [M, V] -> [M]."""
