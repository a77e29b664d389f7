"""Acceptance rules, importable as `mmspec.acceptance` (one file per rule).

`RULES` maps a name to a rule class so that `speculative_generate(acceptance="exact")` and
pipelines can pick a rule by name. Every rule implements `mmspec.AcceptanceRule`.
"""

from __future__ import annotations

from .base import ChainRule, check_chain_inputs
from .cluster_exact import ClusterExactAcceptance
from .continuous import ContinuousAcceptance, ContinuousResult
from .continuous_relaxed import RelaxedContinuousAcceptance
from .exact import ExactAcceptance
from .greedy import GreedyAcceptance
from .grouped import GroupedAcceptance
from .invariant import DrafterInvariantAcceptance
from .lantern import LanternAcceptance
from .typical import TypicalAcceptance

RULES: dict[str, type] = {
    "greedy": GreedyAcceptance,
    "exact": ExactAcceptance,
    "typical": TypicalAcceptance,
    "lantern": LanternAcceptance,  # needs codebook=[V, D]
    "gsd": GroupedAcceptance,  # needs embeddings=[V, D]
    "cluster_exact": ClusterExactAcceptance,  # needs labels=[V]
    "invariant": DrafterInvariantAcceptance,  # sampled output independent of the drafter for a seed
}

# Continuous-token rules verify Gaussian token distributions, not categorical ones; they do
# not run in `speculative_generate` (MAR's masked-order sampler has its own loop in
# mmspec.pipelines), so they have their own registry.
CONTINUOUS_RULES: dict[str, type] = {
    "continuous": ContinuousAcceptance,
    "continuous-relaxed": RelaxedContinuousAcceptance,  # lossy: CSpD's public-code inner temperature (42)
}


# Rules that cannot be built from a name alone: the table each one needs.
_TABLES: dict[str, tuple[str, str]] = {
    "lantern": ("codebook", "a [V, D] tensor of token latents (e.g. the VQ codebook rows of each image token)"),
    "gsd": ("embeddings", "a [V, D] tensor of token embeddings (e.g. the target's input embedding matrix)"),
    "cluster_exact": ("labels", "a [V] integer tensor of cluster ids, one per token"),
}


def rule_table(name: str) -> str | None:
    """The table a rule named `name` needs to be built (LANTERN's "codebook", GSD's "embeddings",
    cluster_exact's "labels"), or None."""
    return _TABLES[name][0] if name in _TABLES else None


def _init_params(cls) -> tuple[str, ...] | None:
    """Keyword names `cls(...)` accepts (None: any, it takes **kwargs)."""
    code = getattr(cls.__init__, "__code__", None)
    if code is None:
        return ()  # object.__init__: no arguments
    if code.co_flags & 0x08:  # CO_VARKEYWORDS
        return None
    return code.co_varnames[1 : code.co_argcount + code.co_kwonlyargcount]


def get_rule(rule, **kwargs):
    """A rule object from a name in RULES, built with `kwargs` (e.g.
    `get_rule("lantern", codebook=cb, k=100)`), or a rule object itself (then `kwargs` must
    be empty). Raises a ValueError naming the table a rule needs when it is missing, and a
    TypeError for a rule class passed instead of an instance."""
    if isinstance(rule, str):
        if rule in CONTINUOUS_RULES:
            raise ValueError(
                f"acceptance={rule!r} verifies continuous tokens; it runs in the MAR pipeline's own loop "
                "(mmspec.pipelines), not in speculative_generate. Build it with get_continuous_rule"
            )
        if rule not in RULES:
            raise ValueError(f"acceptance={rule!r} is not a known rule; choose one of {sorted(RULES)} or pass a rule object")
        if rule in _TABLES and _TABLES[rule][0] not in kwargs:
            table, what = _TABLES[rule]
            raise ValueError(
                f"acceptance={rule!r} needs its {table} table ({what}); pass it via "
                f"acceptance_kwargs={{'{table}': ...}} or pass a rule object, e.g. "
                f"acceptance={RULES[rule].__name__}({table}=...)"
            )
        params = _init_params(RULES[rule])
        unknown = sorted(k for k in kwargs if params is not None and k not in params)
        if unknown:
            raise TypeError(f"acceptance={rule!r} takes no argument(s) {unknown}; its arguments are {list(params)}")
        return RULES[rule](**kwargs)
    if isinstance(rule, type):
        raise TypeError(
            f"acceptance={rule.__name__} is a class; pass an instance (acceptance={rule.__name__}(...)) "
            f"or a name in {sorted(RULES)}"
        )
    if not hasattr(rule, "verify"):
        raise TypeError(
            f"acceptance must be a name in {sorted(RULES)} or an object implementing mmspec.AcceptanceRule, got {type(rule).__name__}"
        )
    if kwargs:
        raise ValueError(
            f"acceptance arguments {sorted(kwargs)} apply to a rule given by name only; acceptance is already "
            f"the object {type(rule).__name__}, so build it with those arguments instead"
        )
    return rule


def is_position_keyed(rule) -> bool:
    """Whether `rule` (a name in RULES or a rule object) samples with position-keyed noise, so
    that its plain decoding is the reference its speculative output equals for a seed."""
    cls = RULES.get(rule) if isinstance(rule, str) else rule
    return bool(getattr(cls, "position_keyed", False))


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
    "rule_table",
    "get_rule",
    "is_position_keyed",
    "ChainRule",
    "check_chain_inputs",
    "ClusterExactAcceptance",
    "ContinuousAcceptance",
    "ContinuousResult",
    "DrafterInvariantAcceptance",
    "RelaxedContinuousAcceptance",
    "ExactAcceptance",
    "GreedyAcceptance",
    "GroupedAcceptance",
    "LanternAcceptance",
    "TypicalAcceptance",
]
