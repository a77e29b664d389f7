"""Small data types passed between the speculative components.

Every tensor field carries a shape comment. B is the number of *active* rows of the batch
(finished rows are dropped from the working batch), N the number of draft nodes (a chain of
K tokens is a tree of N = K nodes whose parents are [-1, 0, 1, ...]), V the vocabulary.
Node index 0 of a verify call is always the *root*: the last committed token, which is not
yet in any cache; draft node i sits at verify position i + 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class TreeConfig:
    """EAGLE-2 dynamic draft tree: expand the `top_k` best children of the `top_k` best
    frontier nodes for `depth` levels (ranked by cumulative draft log-prob), then keep the
    `num_nodes` best nodes of the whole tree (Li et al. 2024, EAGLE-2, section 4)."""

    depth: int = 5
    top_k: int = 4
    num_nodes: int = 24

    def __post_init__(self) -> None:
        for name in ("depth", "top_k", "num_nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"TreeConfig.{name} must be an int, got {value!r} ({type(value).__name__})")
        if self.depth < 1:
            raise ValueError(f"TreeConfig.depth must be >= 1, got {self.depth}")
        if self.top_k < 1:
            raise ValueError(f"TreeConfig.top_k must be >= 1, got {self.top_k}")
        if self.num_nodes < 1:
            raise ValueError(f"TreeConfig.num_nodes must be >= 1, got {self.num_nodes}")
        if self.num_nodes > self.depth * self.top_k * self.top_k:
            raise ValueError(
                f"TreeConfig.num_nodes={self.num_nodes} exceeds the depth*top_k*top_k="
                f"{self.depth * self.top_k * self.top_k} candidates the tree can hold; lower num_nodes"
            )


@dataclass
class Draft:
    """What a drafter proposes for every active row.

    `parents[b, i]` is the node index (0..N-1) of node i's parent, or -1 when its parent is
    the root. Parents always precede children. A chain has parents [-1, 0, 1, ..., N-2].
    `draft_probs` is the distribution each node was sampled from; None means a
    deterministic drafter (q = one_hot(token)), which is always the case for trees.
    """

    tokens: torch.Tensor  # [B, N] long
    parents: torch.Tensor  # [B, N] long, -1 = root
    draft_probs: torch.Tensor | None = None  # [B, N, V] float, chains only
    is_chain: bool = True

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]


@dataclass
class TargetOutput:
    """One target forward over [root] + draft nodes."""

    logits: torch.Tensor  # [B, N+1, V] processed-ready logits (CFG already applied)
    hidden_states: torch.Tensor | None = None  # [B, N+1, H] last hidden state, for EAGLE-style drafters


@dataclass
class AcceptanceResult:
    """Per-row outcome of verifying a chain: the first `num_accepted[b]` draft tokens are kept
    and `next_tokens[b]` (recovered or bonus token) is appended after them."""

    num_accepted: torch.Tensor  # [B] long, 0..K
    next_tokens: torch.Tensor  # [B] long
    distortion: torch.Tensor | None = None  # [B] float, total variation this step moved (lossy rules)
    accept_probs: torch.Tensor | None = None  # [B, K] float, acceptance probability per position


@dataclass
class TreeAcceptance:
    """Per-row outcome of verifying a tree: the accepted path as verify positions.

    `path[b, :num_accepted[b] + 1]` are verify positions (0 = root) of the kept tokens; the
    rest is padded with the last valid position."""

    path: torch.Tensor  # [B, D+1] long, verify positions, path[:, 0] == 0
    num_accepted: torch.Tensor  # [B] long
    next_tokens: torch.Tensor  # [B] long
    distortion: torch.Tensor | None = None  # [B] float


@dataclass
class CommitInfo:
    """What the core tells target and drafter after a step, before they roll back."""

    path: torch.Tensor  # [B, D+1] verify positions of kept tokens (root first)
    num_accepted: torch.Tensor  # [B] long
    accepted_tokens: torch.Tensor  # [B, D] long, padded with -1 past num_accepted
    next_tokens: torch.Tensor  # [B] long: the new root
    is_chain: bool = True  # chains keep a prefix of the verified tokens: no compaction needed
    num_accepted_list: list[int] = field(default_factory=list)  # host copy (the step's one sync)
