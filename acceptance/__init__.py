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
}

# Continuous-token rules verify Gaussian token distributions, not categorical ones; they do
# not run in `speculative_generate` (MAR's masked-order sampler has its own loop in
# mmspec.pipelines), so they have their own registry.
CONTINUOUS_RULES: dict[str, type] = {
    "continuous": ContinuousAcceptance,
}


def get_rule(rule, **kwargs):
    """A rule object from a name in RULES (built with kwargs) or a rule object itself."""
    if isinstance(rule, str):
        if rule in CONTINUOUS_RULES:
            raise ValueError(
                f"acceptance={rule!r} verifies continuous tokens; it runs in the MAR pipeline's own loop "
                "(mmspec.pipelines), not in speculative_generate. Build it with get_continuous_rule"
            )
        if rule not in RULES:
            raise ValueError(f"acceptance={rule!r} is not a known rule; choose one of {sorted(RULES)} or pass a rule object")
        return RULES[rule](**kwargs)
    if not hasattr(rule, "verify"):
        raise TypeError(
            f"acceptance must be a name in {sorted(RULES)} or an object implementing mmspec.AcceptanceRule, got {type(rule).__name__}"
        )
    return rule


def get_continuous_rule(rule, **kwargs):
    """A continuous-token rule from a name in CONTINUOUS_RULES (built with kwargs) or the object itself."""
    if isinstance(rule, str):
        if rule not in CONTINUOUS_RULES:
            raise ValueError(f"unknown continuous rule {rule!r}; choose one of {sorted(CONTINUOUS_RULES)}")
        return CONTINUOUS_RULES[rule](**kwargs)
    return rule


__all__ = [
    "CONTINUOUS_RULES",
    "RULES",
    "get_continuous_rule",
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
