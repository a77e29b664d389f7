"""The three interfaces of the speculative loop: `Target`, `Drafter`, `AcceptanceRule`, and
the checks that enforce them (`check_target`, `check_drafter`, `check_rule`).

One step of `mmspec.speculative_generate` for the B active rows is

    draft   = drafter.propose(roots, sampling, generator)      # Draft: chain or tree
    out     = target.verify(roots_and_draft, parents)          # ONE forward, [B, N+1, V] logits
    verdict = verify_draft(rule, draft, probs)                 # per-row accepted path
    target.commit(info); drafter.commit(info, out)             # roll caches back per row

Each component owns its own state (KV caches, image features, CFG halves, Jacobi windows);
the loop only moves tokens and node indices between them. Everything the loop reads is
declared here: required members are checked before the first step (a missing one is a
TypeError naming it); optional capabilities have a documented default.

How the families plug in (see docs/architecture.md): transformers models through
`mmspec.models.HFTarget` (a `SpecTarget` over the transformers forward spec); our own models
(LlamaGen) through their own `mmspec.spec.ForwardSpec`; CFG through `mmspec.GuidedTarget`;
EAGLE-style heads are drafters declaring a `FeatureRequest`. MAR (masked order, no causal
cache) does not run in this loop: it has its own loop in `mmspec.pipelines`, reusing
`mmspec.acceptance.ContinuousAcceptance` and `SpecStats`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from mmspec.sampling import SamplingConfig
from mmspec.types import AcceptanceResult, CommitInfo, Draft, FeatureRequest, TargetOutput


@runtime_checkable
class Target(Protocol):
    """The model whose distribution the output must follow.

    Optional capabilities:
    - `supports_features: bool` (default False): the target honours a non-empty
      `FeatureRequest` in `prefill`. A drafter that requests features with a target that does
      not support them is refused before the first step.
    - `check_inputs(input_ids, attention_mask, model_inputs)`: refuse (ValueError naming it)
      model inputs the target would refuse at `prefill`, without running a forward. The loop
      calls it for a request with `max_new_tokens=0`, which runs no prefill, so that a
      misspelt option is refused at every length; a target without it goes unchecked there.
    - `stop_requested: bool`: read after every step; True ends the request there (each row keeps
      what it emitted, the stats count what ran). The image pipeline's callback stop uses it.
    - `placeholder_token_ids: dict[str, list[int]]` ("image" / "video"; default none): a VLM's
      placeholder tokens, which `GuidedTarget` counts to split image features between its halves
      and to check an unconditional half that reuses the conditional model inputs.
    - `max_positions: int | None` (default None: unbounded): the size of a learnt position table;
      a request that could reach past it is refused up front (a `cappable` chain is held short).
    - `max_output_tokens: int` (default unbounded): the most tokens the target generates (an
      image's token grid); a larger `max_new_tokens` is refused.
    - `acceptance_tables() -> dict[str, Tensor]`: tables a rule named by string needs (LANTERN's
      `codebook`, GSD's `embeddings`, cluster_exact's `labels`), used unless the caller passes
      them in `acceptance_kwargs`.
    - `kernels: str`: a label of the kernels it runs on, reported in `SpecStats.kernels`.

    For a `prefill` / `verify` written outside mmspec the loop checks each returned
    `TargetOutput` (type, logits [B, N+1, V]; prefill [B, L, V] with the last column read)."""

    vocab_size: int

    def prefill(
        self,
        input_ids: torch.Tensor,  # [B, L] left-padded
        attention_mask: torch.Tensor,  # [B, L] 1 = real token
        model_inputs: dict[str, Any],  # pixel_values, image_grid_thw, ... (refuse what you do not use)
        max_new_tokens: int,
        max_draft_nodes: int,
        features: FeatureRequest,  # what the drafter reads; return exactly this, here and at every verify
    ) -> TargetOutput:  # logits [B, 1, V] at the last prompt position
        ...

    def verify(
        self,
        tokens: torch.Tensor,  # [B, N+1] root + draft nodes
        parents: torch.Tensor | None,  # [B, N] parent node of each draft node (-1 = root); None = chain
    ) -> TargetOutput:  # logits [B, N+1, V]
        ...

    def commit(self, info: CommitInfo) -> None:
        """Keep root + accepted path in the cache, drop the rest (per row)."""

    def select_rows(self, rows: torch.Tensor, rows_host: list[int]) -> None:
        """Keep only these batch rows ([B'] long, and the same as a host list), in order."""


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens for every active row.

    Optional capabilities:
    - `features: FeatureRequest` (default: none): what the drafter reads from the target's
      outputs (hidden-state layers, image features, positions).
    - `draft_calls: int` (default: not reported): drafter forwards of the current request (prompt
      prefill, catch-up, drafting), reset at `prefill`, for `SpecStats`.
    - `set_stop_tokens(token_ids: list[int])`: called before each request's `prefill` with the
      loop's EOS ids (possibly empty); a chain drafter may then end a chain early once every
      row has drafted one (what follows a row's EOS is never emitted).
    - `set_position_noise(noise | None)`: under a position-keyed rule (`acceptance="invariant"`)
      called before each `propose` with `noise(n, dtype) -> E [B, n, V]`, the verifier's Exp(1)
      race noise of the n positions after each row's root (None at a request's start): drafting
      ``argmax(q / E)`` is then accepted wherever the verifier's perturbed argmax agrees.
    - `cappable: bool` with `cap_draft_length(n)` (default: not capped): the loop may hold the
      next chain to n drafts (what the longest row can still emit, or room before a position
      table's end), called before each `propose`.
    - `adaptive: bool` with `set_draft_length(k)` (default: a fixed length): the loop chooses each
      step's draft length k (0..max_draft_nodes; 0 = a plain step) and calls `set_draft_length(k)`
      before `propose`; its choices come from `controller` when the drafter has one (e.g. a
      `mmspec.adaptive.DraftLengthController` that keeps learning across calls), else from a
      fresh `DraftLengthController(max_draft_nodes)` per call. `adaptive` without a callable
      `set_draft_length` is a TypeError.
    - `tree` (a `TreeConfig` or None): a tree's `depth` bounds how far past its root a step's
      drafts reach (checked against `max_positions`); `max_positions` and `acceptance_tables()`
      as for a target.
    - `shadow_probes: bool`: the drafter can score a plain stretch for the adaptive controller
      (`mmspec.shadow_acceptance`; mmspec's `ModelDrafter`).

    `propose` returns a `Draft` of `torch.long` tokens and parents `[active rows, N]`; for
    a `propose` written outside mmspec the loop checks that, at most `max_draft_nodes` nodes,
    and, on the CPU, the token ids, a chain's or tree's parents and the draft distributions
    (rows summing to 1, chains only, each drafted token given a positive probability)."""

    vocab_size: int
    max_draft_nodes: int  # the most nodes `propose` returns (the target reserves cache room)

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
    trees sibling by sibling (docs/algorithms.md, "Trees").

    Optional capabilities:
    - `verify_unchecked(...)`: `verify` without input validation (no host sync); the loop
      prefers it since it builds well-formed inputs itself.
    - `at_temperature_zero() -> AcceptanceRule`: the rule to use for greedy decoding (exact
      verification of one-hot targets is greedy verification).
    - `distortion(x, p, q) -> [M]`: total variation a lossy rule moves (reported in stats);
      optionally `distortion_given(x, p, q, alpha)`, the same from an alpha already computed.
    - `position_keyed: bool` (default False): the loop replaces the target's distributions by the
      one-hots of their Gumbel-max tokens under position-keyed noise (`mmspec.position_noise`)
      before the rule sees them; with `verify_top(draft_tokens, top) -> AcceptanceResult` chains
      are verified from those tokens directly (`DrafterInvariantAcceptance`).
    - `greedy_only: bool` (default False): the rule is refused when sampling (temperature > 0).
    - `accept_and_distortion(x, p, q) -> (alpha [M], distortion [M])`: trees take both from one
      call where the rule has it.

    For a `verify` written outside mmspec the loop checks each result: `num_accepted` and
    `next_tokens` long tensors [B] and, on the CPU, 0 <= num_accepted <= K and next tokens in the
    vocabulary."""

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


_TARGET_REQUIRED = ("vocab_size", "prefill", "verify", "commit", "select_rows")
_DRAFTER_REQUIRED = ("vocab_size", "max_draft_nodes", "prefill", "propose", "commit", "select_rows")
_RULE_REQUIRED = ("lossless", "verify", "accept_probability", "residual", "sample")


def _missing(obj, names) -> list[str]:
    return [n for n in names if not hasattr(obj, n)]


def is_target(obj) -> bool:
    return not _missing(obj, _TARGET_REQUIRED)


def implements_drafter(obj) -> bool:
    """Whether `obj` has every member of the Drafter protocol (a cheap check, no values read)."""
    return not _missing(obj, _DRAFTER_REQUIRED)


def check_target(target) -> None:
    missing = _missing(target, _TARGET_REQUIRED)
    if missing:
        hint = ("; it is a drafter: did you swap target and drafter?" if implements_drafter(target) else "")
        raise TypeError(f"target {type(target).__name__} does not implement mmspec.Target: it lacks {missing}{hint}")


def check_drafter(drafter) -> FeatureRequest:
    """Check the Drafter protocol; returns the drafter's feature request (empty if none)."""
    missing = _missing(drafter, _DRAFTER_REQUIRED)
    if missing:
        hint = ("; a model drafts through mmspec.drafters.ModelDrafter(model)"
                if hasattr(drafter, "config") and callable(drafter) else "")
        raise TypeError(f"drafter {type(drafter).__name__} does not implement mmspec.Drafter: it lacks {missing}{hint}")
    nodes = drafter.max_draft_nodes
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 0:
        raise TypeError(f"drafter.max_draft_nodes must be an int >= 0, got {nodes!r}")
    features = getattr(drafter, "features", None)
    if features is None:
        return FeatureRequest()
    if not isinstance(features, FeatureRequest):
        raise TypeError(f"drafter.features must be an mmspec.FeatureRequest, got {type(features).__name__}")
    return features


def check_rule(rule) -> None:
    missing = _missing(rule, _RULE_REQUIRED)
    if missing:
        raise TypeError(
            f"acceptance rule {type(rule).__name__} does not verify discrete tokens (it lacks {missing}); "
            "continuous-token rules (mmspec.acceptance.CONTINUOUS_RULES) run through the MAR pipeline's own loop"
        )
