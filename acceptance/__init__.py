"""Acceptance rules, importable as `mmspec.acceptance` (one file per rule).

`RULES` maps a name to a rule class so that `speculative_generate(acceptance="exact")` and
pipelines can pick a rule by name. Every rule implements `mmspec.AcceptanceRule`.
"""

from __future__ import annotations

from .base import ChainRule, check_chain_inputs
from .cluster_exact import ClusterExactAcceptance
from .continuous import ContinuousAcceptance, ContinuousResult
from .exact import ExactAcceptance
from .greedy import GreedyAcceptance
from .grouped import GroupedAcceptance
from .lantern import LanternAcceptance
from .typical import TypicalAcceptance

RULES: dict[str, type] = {
    "greedy": GreedyAcceptance,
    "exact": ExactAcceptance,
    "typical": TypicalAcceptance,
    "lantern": LanternAcceptance,  # needs codebook=[V, D]
    "gsd": GroupedAcceptance,  # needs embeddings=[V, D]
    "cluster_exact": ClusterExactAcceptance,  # needs labels=[V]
    "continuous": ContinuousAcceptance,  # continuous tokens: its own verify signature
}


def get_rule(rule, **kwargs):
    """A rule object from a name in RULES (built with kwargs) or a rule object itself."""
    if isinstance(rule, str):
        if rule not in RULES:
            raise ValueError(f"acceptance={rule!r} is not a known rule; choose one of {sorted(RULES)} or pass a rule object")
        return RULES[rule](**kwargs)
    if not hasattr(rule, "verify"):
        raise TypeError(
            f"acceptance must be a name in {sorted(RULES)} or an object implementing mmspec.AcceptanceRule, got {type(rule).__name__}"
        )
    return rule


__all__ = [
    "RULES",
    "get_rule",
    "ChainRule",
    "check_chain_inputs",
    "ClusterExactAcceptance",
    "ContinuousAcceptance",
    "ContinuousResult",
    "ExactAcceptance",
    "GreedyAcceptance",
    "GroupedAcceptance",
    "LanternAcceptance",
    "TypicalAcceptance",
]
