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

from mmspec.sampling import plain_number


@dataclass(frozen=True)
class TreeConfig:
    """EAGLE-2 dynamic draft tree: expand the `top_k` best children of the `top_k` best
    frontier nodes for `depth` levels (ranked by cumulative draft log-prob), then keep the
    `num_nodes` best nodes of the whole tree (Li et al. 2024, EAGLE-2, section 4).

    `num_nodes="auto"` (`ModelDrafter`, EAGLE and ViSpec trees): how many nodes to keep, 0 (plain decoding) up to
    24 (at most the tree's candidates, top_k + (depth - 1) * top_k^2), is chosen per request from measured speed
    (`mmspec.adaptive_window.WindowBandit`); it is stored as `adaptive=True` with `num_nodes`
    the largest (`TreeConfig(num_nodes=32, adaptive=True)` for another largest)."""

    depth: int = 5
    top_k: int = 4
    num_nodes: int | str = 24
    adaptive: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.adaptive, bool):
            raise TypeError(f"TreeConfig.adaptive must be a bool, got {self.adaptive!r}")
        for name in ("depth", "top_k", "num_nodes"):  # np.int64(6) means 6
            object.__setattr__(self, name, plain_number(getattr(self, name)))
        if self.num_nodes == "auto":
            object.__setattr__(self, "adaptive", True)
            if all(isinstance(getattr(self, n), int) and not isinstance(getattr(self, n), bool) for n in ("depth", "top_k")):
                object.__setattr__(self, "num_nodes", max(1, min(24, self.candidates)))
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
        if self.num_nodes > self.candidates:
            # (before session 34 the bound was depth * top_k^2, and a larger count was silently cut)
            raise ValueError(
                f"TreeConfig.num_nodes={self.num_nodes} exceeds the top_k + (depth-1)*top_k^2="
                f"{self.candidates} candidates the tree can hold; lower num_nodes"
            )

    @property
    def candidates(self) -> int:
        """Nodes the grown tree holds before the best `num_nodes` are kept: `top_k` children of the
        root, then `top_k` children of each of the `top_k` frontier nodes per further level."""
        return self.top_k + (self.depth - 1) * self.top_k * self.top_k


def check_tree(tree, who: str, adaptive_ok: bool) -> None:
    """`tree` must be None or a TreeConfig; an adaptive one (num_nodes="auto") only where `who`
    chooses the size (TypeError / ValueError naming it)."""
    if tree is None:
        return
    if not isinstance(tree, TreeConfig):
        raise TypeError(f"tree must be None or an mmspec.TreeConfig, got {type(tree).__name__}")
    if tree.adaptive and not adaptive_ok:
        raise ValueError(f"{who} does not choose a tree's size by measurement (TreeConfig(num_nodes='auto')); give "
                         "num_nodes=N, or draft chains with num_draft_tokens='auto'")


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
    depth: int | None = None  # trees: the deepest level drafted, at most (stats' positions offered)

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]


@dataclass(frozen=True)
class FeatureRequest:
    """What a drafter reads from the target besides logits. The target computes exactly this,
    at prefill and at every verify (for CFG targets: per half), and nothing more.

    `hidden_layers` are decoder-layer indices (0-based, output of that layer before the final
    norm; negative counts from the end); `last_hidden` is the final normed hidden state (the
    LM head's input); `image_features` the projected image features at prefill (VLMs);
    `positions` the model positions of the verified tokens."""

    hidden_layers: tuple[int, ...] = ()
    last_hidden: bool = False
    image_features: bool = False
    positions: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.hidden_layers, tuple) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in self.hidden_layers
        ):
            raise TypeError(f"FeatureRequest.hidden_layers must be a tuple of ints, got {self.hidden_layers!r}")
        for name in ("last_hidden", "image_features", "positions"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"FeatureRequest.{name} must be a bool, got {getattr(self, name)!r}")

    def __or__(self, other: "FeatureRequest") -> "FeatureRequest":
        return FeatureRequest(
            hidden_layers=tuple(sorted(set(self.hidden_layers) | set(other.hidden_layers))),
            last_hidden=self.last_hidden or other.last_hidden,
            image_features=self.image_features or other.image_features,
            positions=self.positions or other.positions,
        )

    @property
    def empty(self) -> bool:
        return not (self.hidden_layers or self.last_hidden or self.image_features or self.positions)


@dataclass
class TargetOutput:
    """One target forward over [root] + draft nodes (or the prompt, at prefill)."""

    logits: torch.Tensor  # [B, N+1, V] processed-ready logits (CFG already applied); [B, 1, V] at prefill
    hidden_states: torch.Tensor | None = None  # [B, N+1, H] final hidden state (FeatureRequest.last_hidden)
    layer_states: dict[int, torch.Tensor] = field(default_factory=dict)  # layer id -> [B, N+1, H]
    image_features: torch.Tensor | None = None  # [B, I, H] at prefill (FeatureRequest.image_features)
    positions: torch.Tensor | None = None  # model positions of the tokens ([B, Q] or [3, B, Q])
    uncond: "TargetOutput | None" = None  # CFG targets: the same features for the unconditional half


@dataclass
class AcceptanceResult:
    """Per-row outcome of verifying a chain: the first `num_accepted[b]` draft tokens are kept
    and `next_tokens[b]` (recovered or bonus token) is appended after them."""

    num_accepted: torch.Tensor  # [B] long, 0..K
    next_tokens: torch.Tensor  # [B] long
    distortion: torch.Tensor | None = None  # [B] float, total variation this step moved (lossy rules)
    accept_probs: torch.Tensor | None = None  # [B, K] float, acceptance probability per position


@dataclass
class Verdict:
    """Per-row outcome of verifying a step's draft, for chains and trees alike: the accepted
    path as verify positions (a chain's path is `arange`).

    `path[b, :num_accepted[b] + 1]` are verify positions (0 = root) of the kept tokens; the
    rest is padded with the last valid position."""

    path: torch.Tensor  # [B, N+1] long, verify positions, path[:, 0] == 0
    num_accepted: torch.Tensor  # [B] long
    next_tokens: torch.Tensor  # [B] long
    distortion: torch.Tensor | None = None  # [B] float


TreeAcceptance = Verdict  # the name used before chains and trees shared one verdict type


@dataclass
class CommitInfo:
    """What the core tells target and drafter after a step, before they roll back."""

    path: torch.Tensor  # [B, D+1] verify positions of kept tokens (root first)
    num_accepted: torch.Tensor  # [B] long
    accepted_tokens: torch.Tensor  # [B, D] long, padded with -1 past num_accepted
    next_tokens: torch.Tensor  # [B] long: the new root
    num_accepted_list: list[int]  # [B] host copy of num_accepted (the step's one sync); required
    is_chain: bool = True  # chains keep a prefix of the verified tokens: no compaction needed

    def __post_init__(self) -> None:
        if not isinstance(self.num_accepted_list, list) or len(self.num_accepted_list) != self.num_accepted.shape[0]:
            raise ValueError(
                "CommitInfo.num_accepted_list must be a host list with one count per active row "
                f"({self.num_accepted.shape[0]}), got {self.num_accepted_list!r}"
            )
