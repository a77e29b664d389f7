"""The speculative loop: `speculative_generate`.

Per step, for the B active rows (finished rows are dropped from the working batch, so they
stop costing draft *and* verify work):

    draft   = drafter.propose(roots)                       # chain [B, K] or tree [B, N]
    out     = target.verify([roots | draft], parents)      # ONE target forward
    verdict = verify_draft(rule, draft, probs)             # per-row accepted path
    target.commit(info); drafter.commit(info, out)         # per-row rollback

Output bookkeeping (EOS, `max_new_tokens`, finished rows) lives in `mmspec.emit._Emitter`.
The only host sync per step is the `.tolist()` that tells the host how many tokens each row
kept (and whether it finished); everything else stays on the device (on the CPU, where a sync
costs nothing, the bookkeeping after it runs on the host: `mmspec/emit.py`). Greedy (`temperature=0`) output
equals plain greedy decoding token for token; with a lossless rule (`"exact"`) sampled output
is distributed like plain sampling with the same temperature, top-k and top-p (Leviathan et
al. 2023; Chen et al. 2023).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from mmspec.in_use import exclusive
from mmspec.adaptive import DraftLengthController
from mmspec.protocols import check_drafter, check_rule, check_target, is_target
from mmspec.sampling import SamplingConfig, check_generator, plain_number, probs_finite, process_logits
from mmspec.stats import SpecStats
from mmspec.timing import PhaseTimer
from mmspec.position_noise import PositionNoise
from mmspec.tree import chain_verify_name, verify_draft
from mmspec.emit import _Emitter
from mmspec.foreign_checks import check_draft, check_target_output, check_verdict, written_outside
from mmspec.types import Draft


@dataclass
class SpecOutput:
    sequences: torch.Tensor  # [B, L + N] prompt + new tokens, padded with pad_token_id after EOS
    stats: SpecStats


def as_target(target):
    """An `mmspec.Target`: returned as is, or an HF model wrapped in `HFTarget`."""
    if is_target(target):
        return target
    if hasattr(target, "config") and callable(target):
        from mmspec.models.hf_target import HFTarget  # adapters may import transformers

        return HFTarget(target)
    check_target(target)  # raises a TypeError naming what is missing
    return target


def _eos_list(eos_token_id) -> list[int]:
    if eos_token_id is None:
        return []
    eos_token_id = plain_number(eos_token_id)
    ids = [eos_token_id] if isinstance(eos_token_id, int) and not isinstance(eos_token_id, bool) else eos_token_id
    if isinstance(ids, torch.Tensor):
        ids = ids.flatten().tolist()
    ids = [plain_number(i) for i in ids] if isinstance(ids, (list, tuple)) else [ids]
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"eos_token_id must be None, an int >= 0 or a non-empty list of them, got {eos_token_id!r}")
    return ids


def _check_inputs(input_ids, attention_mask, max_new_tokens, pad_token_id=None, eos=()):
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError(
            f"input_ids must be a LongTensor of shape [batch, length], got "
            f"{getattr(input_ids, 'dtype', type(input_ids))} {tuple(getattr(input_ids, 'shape', ()))}"
        )
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must hold at least one row and one token per row, got shape "
                         f"{tuple(input_ids.shape)}")
    if input_ids.is_meta:
        raise ValueError("input_ids is on the 'meta' device (a tensor without values); pass the token ids on the "
                         "model's device")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if attention_mask is None:
        # As transformers' generate: a pad_token_id given, found in input_ids and not an EOS id marks padding.
        if pad_token_id is None or pad_token_id in eos or not bool((input_ids == pad_token_id).any()):  # SYNC: once
            return torch.ones_like(input_ids)
        try:
            return check_attention_mask((input_ids != pad_token_id).long(), input_ids)
        except ValueError:
            raise ValueError(
                f"attention_mask=None: like transformers' generate, mmspec then takes padding from pad_token_id="
                f"{pad_token_id} (it occurs in input_ids and is not an EOS id), but it occurs inside or fills a prompt, "
                "so the prompts are not left-padded; pass the tokenizer's attention_mask, or a pad_token_id the "
                "prompts do not hold"
            ) from None
    return check_attention_mask(attention_mask, input_ids)


def check_attention_mask(mask, ids: torch.Tensor, name: str = "attention_mask", ids_name: str = "input_ids"
                         ) -> torch.Tensor:
    """`mask` as a long tensor, refused by name unless it is one left-padded 0 / 1 row per row of
    `ids` with at least one token each (the loop's prompts and GuidedTarget's unconditional ones).
    -1 for padding was read as a token (a silently different answer), 0.5 as padding. SYNC: one
    host read, once per request."""
    if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
        raise ValueError(f"{name} must have the shape of {ids_name} {tuple(ids.shape)}, got "
                         f"{tuple(getattr(mask, 'shape', ()))}")
    check_same_device(name, mask, ids, ids_name)
    am = mask.long()
    odd = (mask != 0) & (mask != 1)
    bad_value, not_left, empty = torch.stack([odd.any(), (am[:, 1:] < am[:, :-1]).any(), (am.sum(1) == 0).any()]).tolist()
    if bad_value:
        raise ValueError(f"{name} must hold 0 / 1: only 0 (padding) and 1 (a real token), as a tokenizer returns it; "
                         f"got other values, e.g. {mask[odd][0].item()!r}")
    if not_left or empty:
        raise ValueError(f"{name} must be left-padded (zeros only before each row's first token) and give every row at "
                         "least one token; re-tokenize with padding_side='left'")
    return am


def check_same_device(name: str, tensor: torch.Tensor, ids: torch.Tensor, ids_name: str = "input_ids") -> None:
    """Refuse `tensor` by name on the 'meta' device or on another device than `ids` (a raw
    device error came from deep in the forward). No host read."""
    if tensor.is_meta:
        raise ValueError(f"{name} is on the 'meta' device (a tensor without values); pass real values on "
                         f"{ids_name}'s device ({ids.device})")
    if tensor.device != ids.device:
        raise ValueError(f"{name} is on {tensor.device} but {ids_name} is on {ids.device}; move them to one device "
                         f"(the model's), e.g. {name}.to({ids_name}.device)")


def _check_positions(target, drafter, length: int, max_new_tokens: int) -> int | None:
    """Refuse a request that could run past an absolute position table (GPT-2's
    `n_positions`): plain decoding feeds positions up to length + max_new_tokens - 2, and a
    step's drafts reach up to `max_draft_nodes` positions past its root (the last step's
    root included), where the lookup would fail deep in the forward. A chain drafter that can
    be capped (`cappable`: ModelDrafter and head-drafter chains) is instead held, step by step,
    to the room left before the table's end: returns that table size, or None when no cap is
    needed."""
    if max_new_tokens == 0:
        return None
    # How far past its root a step's drafts reach: a tree's depth (not its node count); none when
    # the request emits one token (the prefill's, no step drafts).
    tree = getattr(drafter, "tree", None)
    depth = 0 if max_new_tokens == 1 else int(getattr(tree, "depth", None) or getattr(drafter, "max_draft_nodes", 0) or 0)
    plain = length + max_new_tokens - 1  # positions plain decoding feeds
    cap = None
    for role, part in (("target", target), ("drafter", drafter)):
        limit = getattr(part, "max_positions", None)
        if limit is None or plain + depth <= limit:
            continue
        table = f"the {role}'s position table holds ({limit})"
        if length > limit:
            raise ValueError(f"the prompt's {length} positions are more than {table}; shorten the prompt"
                             + (" or use a drafter with a longer table" if role == "drafter" else ""))
        if plain > limit:
            raise ValueError(f"prompt length {length} + max_new_tokens {max_new_tokens} needs {plain} positions, more "
                             f"than {table}; lower max_new_tokens to {limit - length + 1}")
        if getattr(drafter, "cappable", False):
            cap = limit if cap is None else min(cap, limit)
            continue
        fits = limit - length + 1 - depth
        raise ValueError(
            f"prompt length {length} + max_new_tokens {max_new_tokens} + up to {depth} draft positions may need "
            f"{plain + depth} positions, more than {table}; draft fewer tokens (a shallower tree or chain)"
            + (f" or lower max_new_tokens to {fits}" if fits > 0 else "")
        )
    return cap


def _rule_tables(acceptance, kwargs: dict, target, drafter) -> dict:
    """Fill the tables a rule named by string needs (LANTERN's `codebook`, GSD's
    `embeddings`, cluster_exact's `labels`) from what the target or drafter expose through
    `acceptance_tables()`, unless the caller passed them in `acceptance_kwargs`."""
    import inspect

    from mmspec.acceptance import RULES

    cls = RULES.get(acceptance)
    if cls is None:
        return kwargs
    required = [
        name for name, prm in inspect.signature(cls).parameters.items()
        if prm.default is inspect.Parameter.empty and prm.kind is prm.POSITIONAL_OR_KEYWORD and name not in kwargs
    ]
    if not required:
        return kwargs
    tables: dict = {}
    for owner in (drafter, target):
        provide = getattr(owner, "acceptance_tables", None)
        if callable(provide):
            tables = {**provide(), **tables}
    missing = [name for name in required if name not in tables]
    if missing:
        raise ValueError(
            f"acceptance={acceptance!r} needs {missing}, which neither the target nor the drafter provides "
            f"(acceptance_tables()); pass a configured rule object as acceptance= (e.g. "
            f"{RULES[acceptance].__name__}({missing[0]}=...)), or to speculative_generate "
            f"acceptance_kwargs={{{missing[0]!r}: tensor}}"
        )
    return {**kwargs, **{name: tables[name] for name in required}}


def resolve_rule(acceptance, acceptance_kwargs, sampling: SamplingConfig, target, drafter):
    """The acceptance rule a request runs, as `speculative_generate` builds it: a rule name (with
    `acceptance_kwargs` and the tables a target provides, e.g. a VQ codebook) or a rule object,
    checked against the protocol and the sampling settings (a greedy-only rule is refused when
    sampling; at temperature 0 a rule's greedy form is taken). Pipelines call it to refuse bad
    options before any work, then pass the returned object on."""
    from mmspec.acceptance import get_rule  # core -> rules only at call time (layering)

    if acceptance_kwargs is not None and not isinstance(acceptance, str):
        raise ValueError("acceptance_kwargs is only used with a rule name; configure a rule object directly")
    if acceptance_kwargs is not None and not isinstance(acceptance_kwargs, dict):
        raise TypeError(f"acceptance_kwargs must be a dict, got {type(acceptance_kwargs).__name__}")
    kwargs = dict(acceptance_kwargs or {})
    if isinstance(acceptance, str):
        kwargs = _rule_tables(acceptance, kwargs, target, drafter)
    rule = get_rule(acceptance, **kwargs)
    check_rule(rule)
    if getattr(rule, "greedy_only", False) and not sampling.greedy:
        raise ValueError(
            f"acceptance={getattr(rule, 'name', type(rule).__name__)!r} decodes greedily (argmax) and would ignore "
            f"temperature={sampling.temperature}; pass temperature=0 for greedy decoding, or acceptance='exact' to sample")
    if sampling.greedy and hasattr(rule, "at_temperature_zero"):
        rule = rule.at_temperature_zero()
    return rule


def _plain_k0(rule) -> bool:
    """Whether a K = 0 step may skip the chain machinery: the rule's K = 0 verdict must be
    `rule.sample(p)` of the target's processed distribution. True for the shared chain
    verification, and for greedy verification (its K = 0 next token is the argmax, which is
    what `GreedyAcceptance.sample` returns) unless a subclass changes either method."""
    from mmspec.acceptance.base import ChainRule  # core -> rules only at call time (layering)
    from mmspec.acceptance.greedy import GreedyAcceptance

    cls = type(rule)
    if not isinstance(rule, ChainRule) or chain_verify_name(rule) != "verify_unchecked":
        return False  # (a `verify` of a user's own runs at every step)
    if cls.verify_unchecked is GreedyAcceptance.verify_unchecked and cls.sample is GreedyAcceptance.sample:
        return True  # greedy verification (also under mmspec's checked `verify`: the loop calls neither)
    return cls.verify is ChainRule.verify and cls.verify_unchecked is ChainRule.verify_unchecked


def _finite(logits: torch.Tensor, probs: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Whether the target's distributions are usable (a 0-dim bool tensor; no sync). Sampled:
    the processed probabilities are finite. Greedy: the processed distribution is a one-hot,
    finite even for NaN logits, so the logits are checked instead: each row's largest logit
    must be finite (a NaN or +inf logit, or a row of -inf only, would make the argmax
    meaningless; -inf entries beside a finite maximum are masked tokens and fine)."""
    if sampling.greedy:
        return torch.isfinite(logits.amax(-1)).all()
    return probs_finite(probs)


def _finite_host(logits: torch.Tensor, probs: torch.Tensor, sampling: SamplingConfig) -> bool:
    """`_finite` as a host bool (CPU tensors). Probabilities lie in [0, 1], so their sum is
    finite exactly when every entry is."""
    if sampling.greedy:
        return bool(torch.isfinite(logits.amax(-1)).all())
    return _probs_finite_host(probs)


def _probs_finite_host(probs: torch.Tensor) -> bool:
    """`probs_finite` as a host bool: entries in [0, 1] sum to a finite total exactly when
    none is NaN or inf."""
    return math.isfinite(float(probs.sum()))


@torch.no_grad()
def speculative_generate(
    target,
    drafter,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    acceptance: Any = "exact",
    acceptance_kwargs: dict[str, Any] | None = None,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    **model_inputs,
) -> SpecOutput:
    """Generate with speculative decoding (README.md, "Quickstart"; docs/architecture.md).

    `input_ids` [B, L] are left-padded like transformers' batched generation;
    `sequences[:, L:]` are the new tokens. `temperature=0` is greedy. `acceptance` is a rule
    name from `mmspec.acceptance.RULES` (built with `acceptance_kwargs`, e.g. the LANTERN
    codebook) or a rule object. `model_inputs` (pixel_values, image_grid_thw, ...) go to the
    target's prefill; the target refuses any it does not use. `eos_token_id=None` stops rows only
    at `max_new_tokens` (unlike transformers' `generate`, the model's generation config is not
    read): pass the tokenizer's EOS id(s) to end rows there. Finished rows are padded with
    `pad_token_id`, by default the first EOS id (0 without one). `attention_mask=None`: every
    token is real, unless `pad_token_id` is given, occurs in `input_ids` and is not an EOS id
    (then, as in transformers' `generate`, the mask is `input_ids != pad_token_id`)."""
    max_new_tokens, pad_token_id = plain_number(max_new_tokens), plain_number(pad_token_id)
    sampling = SamplingConfig(temperature, top_k, top_p)
    check_generator(generator)
    if pad_token_id is not None and (not isinstance(pad_token_id, int) or isinstance(pad_token_id, bool)
                                     or pad_token_id < 0):
        raise ValueError(f"pad_token_id must be None or an int >= 0, got {pad_token_id!r}")
    eos = _eos_list(eos_token_id)
    attention_mask = _check_inputs(input_ids, attention_mask, max_new_tokens, pad_token_id, eos)
    for name, value in model_inputs.items():  # pixel_values, image_grid_thw, ...: not 'meta' (a model's own
        if isinstance(value, torch.Tensor) and value.is_meta:  # forward may take some, e.g. image_sizes, anywhere)
            check_same_device(name, value, input_ids)
    if pad_token_id is None:
        pad_token_id = eos[0] if eos else 0
    target = as_target(target)
    features = check_drafter(drafter)
    if drafter.vocab_size is None:  # (JacobiDrafter built without it; the image pipeline sets it)
        raise ValueError(f"drafter {type(drafter).__name__} has no vocab_size: build it with vocab_size="
                         f"{target.vocab_size} (the target's vocabulary size)")
    if drafter.vocab_size != target.vocab_size:
        raise ValueError(
            f"drafter vocabulary ({drafter.vocab_size}) differs from the target's ({target.vocab_size}); the drafter "
            "must share the target's tokenizer and vocabulary size"
        )
    position_limit = _check_positions(target, drafter, input_ids.shape[1], max_new_tokens)
    most = getattr(target, "max_output_tokens", None)
    if most is not None and max_new_tokens > most:
        raise ValueError(f"max_new_tokens={max_new_tokens} is more than the {most} tokens target "
                         f"{type(target).__name__} generates (an image's token grid); lower max_new_tokens to {most}")
    if not features.empty and not getattr(target, "supports_features", False):
        raise TypeError(
            f"drafter {type(drafter).__name__} reads target features {features} but target {type(target).__name__} "
            "does not declare supports_features"
        )
    rule = resolve_rule(acceptance, acceptance_kwargs, sampling, target, drafter)
    stats = SpecStats(new_tokens=[0] * input_ids.shape[0], lossless=bool(rule.lossless))
    kernels = [getattr(c, "kernels", "") for c in (target, drafter)]
    stats.kernels = f"target {kernels[0] or 'n/a'}, drafter {kernels[1] or 'n/a'}"
    if max_new_tokens == 0:
        # Nothing to generate, but the inputs are still checked as at any length (a misspelt
        # option or an image on a text model passed here and was refused at 4 tokens).
        check = getattr(target, "check_inputs", None)  # optional Target capability (mmspec/protocols.py)
        if callable(check) and model_inputs:
            check(input_ids, attention_mask, model_inputs)
        return SpecOutput(input_ids.clone(), stats)
    with exclusive(target, drafter):  # one request at a time per object (mmspec/in_use.py)
        loop = _Loop(target, drafter, rule, sampling, generator, stats, input_ids.device)
        if position_limit is not None:  # room before the table's end, from the longest (padded) row
            loop.position_room = (position_limit, input_ids.shape[1])
        emitter = _Emitter(input_ids.shape[0], max_new_tokens, eos, pad_token_id, input_ids.device)
        # A request that raised (Ctrl-C included) or was stopped by the target is not a finished
        # request: a per-request controller (WindowBandit) drops its partial tokens and seconds
        # instead of scoring them, once the drafter's prefill has opened this request (before
        # that, what it holds is the previous, finished request's score).
        abort = getattr(getattr(drafter, "controller", None), "abort_request", None)
        try:
            loop.prefill(input_ids, attention_mask, model_inputs, max_new_tokens, features, emitter)
            while emitter.rows_host:
                loop.step(emitter)
                if getattr(target, "stop_requested", False):  # optional Target capability: end here, stats complete
                    if callable(abort) and emitter.rows_host:
                        abort()
                    break
        except BaseException:
            if callable(abort) and loop.drafter_began:
                abort()
            raise
        return SpecOutput(emitter.sequences(input_ids), loop.finish(emitter))


class _Loop:
    """The four calls of a step, timed per phase."""

    def __init__(self, target, drafter, rule, sampling, generator, stats: SpecStats, device):
        self.target, self.drafter, self.rule = target, drafter, rule
        self.sampling, self.generator, self.stats = sampling, generator, stats
        self.timer = PhaseTimer(device)
        self.t_start = self.timer.mark()
        self.distortion = torch.zeros((), dtype=torch.float64, device=device)
        self.roots: torch.Tensor | None = None
        # Adaptive draft length (drafters built with num_draft_tokens="auto"): the controller
        # may be the drafter's own, so that it keeps learning across calls.
        self.controller = None
        if getattr(drafter, "adaptive", False):
            if not callable(getattr(drafter, "set_draft_length", None)):
                raise TypeError(f"drafter {type(drafter).__name__} says adaptive=True but has no set_draft_length(k), "
                                "through which the loop sets each step's draft length (mmspec.protocols.Drafter)")
            self.controller = getattr(drafter, "controller", None) or DraftLengthController(drafter.max_draft_nodes)
        # mmspec's controller also learns how rows differ in acceptance (per-row counts by row id).
        self._row_ids = isinstance(self.controller, DraftLengthController)
        if self._row_ids:
            self.controller.begin_request()
        # The K = 0 shortcut is taken only for rules whose K = 0 verdict is known to be
        # "sample the target" (the base class's vectorised verify, not overridden).
        self.plain_step = _plain_k0(rule)
        self.position_room: tuple[int, int] | None = None  # (position table size, padded prompt length)
        # Chains the loop may shorten (`cappable`: ModelDrafter, the EAGLE / ViSpec / FLASH heads) are
        # held to what can still be emitted.
        self.end_cap = bool(getattr(drafter, "cappable", False))
        # Drafts that a `propose` written outside mmspec made are checked before they reach the target
        # (a user subclass of an mmspec drafter that keeps its `propose` is not; one set on the
        # instance is).
        self.foreign_drafter = written_outside(drafter, "propose")
        self.verify_name = chain_verify_name(rule)
        self.foreign_rule = written_outside(rule, self.verify_name)
        self.foreign_target = written_outside(target, "verify")
        self.foreign_prefill = written_outside(target, "prefill")
        self.drafter_began = False  # the drafter's prefill has run for this request
        # Drafter-invariant sampling (acceptance="invariant"): the loop perturbs the target's
        # distributions with noise keyed by (seed, row, position) and hands drafters the same noise.
        self.noise = PositionNoise.for_request(generator, target.vocab_size) if getattr(
            rule, "position_keyed", False) else None
        if self._row_ids:  # shadow probes (mmspec/shadow_acceptance.py): greedy, lossless, a drafter that reads them
            self.controller.shadow_capable = bool(getattr(drafter, "shadow_probes", False) and sampling.greedy
                                                  and rule.lossless and self.noise is None)
        self._set_noise = getattr(drafter, "set_position_noise", None)
        if self._set_noise is not None:
            self._set_noise(None)  # no stale noise from an earlier request

    def prefill(self, input_ids, attention_mask, model_inputs, max_new_tokens, features, emitter: _Emitter) -> None:
        tout = self.target.prefill(
            input_ids, attention_mask, model_inputs, max_new_tokens, self.drafter.max_draft_nodes, features
        )
        self.stats.prefill_calls = 1
        if self.foreign_prefill:
            check_target_output(tout, input_ids.shape[0], None, self.target.vocab_size, self.target, "prefill")
        probs = process_logits(tout.logits[:, -1], self.sampling)
        if not bool(_finite(tout.logits[:, -1], probs, self.sampling)):  # SYNC: once, after prefill
            raise ValueError("non-finite probabilities (NaN or inf) from the target's prefill; check the model's dtype "
                             "and inputs (the output would be silently wrong)")
        self.roots = (self.rule.sample(probs, self.generator) if self.noise is None
                      else self.noise.argmax(probs.unsqueeze(1), emitter.rows_host, [0] * len(emitter.rows_host))[:, 0])
        t0 = self.timer.mark()
        set_stop = getattr(self.drafter, "set_stop_tokens", None)
        if set_stop is not None:  # optional: chain drafters end a chain once every row drafted EOS
            set_stop(emitter.eos)
        self.drafter.prefill(input_ids, attention_mask, tout, model_inputs, max_new_tokens)
        self.drafter_began = True  # (after: a prefill that raised early leaves the last request's score)
        self.timer.charge("draft", t0, self.timer.mark())
        keep = emitter.first(self.roots)
        if len(keep) < input_ids.shape[0]:
            self._drop(emitter, keep)

    def step(self, emitter: _Emitter) -> None:
        k = None
        rows = emitter.rows_host  # this step's rows (dropping finished rows replaces the list)
        if self.controller is not None:
            # The batch is done when its slowest row is: the controller weighs that (rows drift
            # apart under speculation, plain steps keep them together).
            remaining = [emitter.max_new - emitter.new_tokens[r] for r in emitter.rows_host]
            k = self.controller.choose(len(emitter.rows_host), remaining)
            self.drafter.set_draft_length(k)
        if self.end_cap:
            # A step emits its accepted drafts and one more token, so a row with r tokens left can
            # use at most r - 1 drafts: a longer chain in the last steps is drafted and verified
            # for nothing (the longest row sets the batch's chain).
            room = max(emitter.max_new - emitter.new_tokens[r] for r in rows) - 1
            if self.position_room is not None:
                # Root positions are prompt + emitted - 1, so a row's drafts may reach limit - 1 at most.
                limit, length = self.position_room
                room = min(room, limit - length - max(emitter.new_tokens[r] for r in rows))
            self.drafter.cap_draft_length(max(room, 0))
        starts = [emitter.new_tokens[r] for r in rows] if self.noise is not None else None
        if starts is not None and self._set_noise is not None:  # draft slot j sits at position starts + j
            self._set_noise(lambda n, dtype, rows=rows, starts=starts: self.noise.race(
                rows, starts, n, dtype=dtype, device=self.roots.device))
        h0 = time.perf_counter()
        t0 = self.timer.mark()
        draft: Draft = self.drafter.propose(self.roots, self.sampling, self.generator)
        if self.foreign_drafter:
            check_draft(draft, len(rows), self.target.vocab_size, emitter.on_host, self.drafter)
        t1 = self.timer.mark()
        h1 = time.perf_counter()
        tokens = torch.cat([self.roots.unsqueeze(1), draft.tokens], 1)  # [Ba, N+1]
        tout = self.target.verify(tokens, None if draft.is_chain else draft.parents)
        if self.foreign_target:
            check_target_output(tout, len(rows), tokens.shape[1], self.target.vocab_size, self.target, "verify")
        if tokens.shape[1] == 1 and self.plain_step:
            # K = 0 (plain decoding, e.g. chosen by the adaptive controller): the rule's own
            # K = 0 answer (sample the target) without the chain machinery around it.
            probs = process_logits(tout.logits[:, -1], self.sampling)  # [Ba, V]
            finite = (_finite_host if emitter.on_host else _finite)(tout.logits[:, -1], probs, self.sampling)
            next_tokens = (self.rule.sample(probs, self.generator) if starts is None
                           else self.noise.argmax(probs.unsqueeze(1), rows, starts)[:, 0])
            info, n_host, count_host, keep = emitter.emit_root(next_tokens, finite)
            verdict = None
        else:
            probs = process_logits(tout.logits, self.sampling)  # [Ba, N+1, V]
            # Checked within the step's one sync; a deterministic draft (no q) is always finite.
            if emitter.on_host:  # on the CPU as host booleans (a read costs no more than an operation there)
                finite = (_finite_host(tout.logits, probs, self.sampling),
                          draft.draft_probs is None or _probs_finite_host(draft.draft_probs))
            else:
                drafted_ok = (probs_finite(draft.draft_probs) if draft.draft_probs is not None
                              else probs.new_ones((), dtype=torch.bool))
                finite = torch.stack([_finite(tout.logits, probs, self.sampling), drafted_ok])
            verdict = (verify_draft(self.rule, draft, probs, generator=self.generator, method=self.verify_name)
                       if starts is None else self.noise.verdict(self.rule, draft, probs, rows, starts, self.verify_name))
            if self.foreign_rule:
                check_verdict(verdict, len(rows), draft.tokens.shape[1], self.target.vocab_size, emitter.on_host,
                              self.rule)
            info, n_host, count_host, keep = emitter.emit(tokens, verdict, finite, draft.is_chain)
        info.is_chain = draft.is_chain
        if verdict is not None and verdict.distortion is not None:  # summed on the device; read once at the end
            self.distortion = self.distortion + verdict.distortion.sum().to(torch.float64)
        self.target.commit(info)
        t2 = self.timer.mark()
        h2 = time.perf_counter()
        self.drafter.commit(info, tout)
        self.stats.record_step(n_host, draft.num_nodes, count_host,
                               draft.num_nodes if draft.is_chain or draft.depth is None else draft.depth)
        self.roots = info.next_tokens
        if len(keep) < len(n_host):
            self._drop(emitter, keep)
        t3 = self.timer.mark()
        if self.controller is not None:
            # Host clocks: the step's sync (in emit) has completed the verify work by h2. On CUDA
            # the drafter's kernels run after propose returns and finish inside that wait, so its
            # share comes from the step's events (done by that sync: no sync added here).
            drafted = self.timer.completed_span(t0, t1)
            if drafted is None:
                seconds = ((h1 - h0) + (time.perf_counter() - h2), h2 - h1)
            else:
                seconds = (drafted + (time.perf_counter() - h2), max(h2 - h0 - drafted, 0.0))
            if draft.is_chain:  # a chain that ended at EOS drafted fewer than k: learn what ran
                k = min(k, draft.tokens.shape[1])
            emitted_hook = getattr(self.controller, "observe_emitted", None)
            if emitted_hook is not None:  # tokens that reached the output (the window / tree bandit)
                emitted_hook(count_host)
            if self._row_ids:
                self.controller.observe(len(n_host), k, n_host, *seconds, rows=rows)
            else:
                self.controller.observe(len(n_host), k, n_host, *seconds)
        self.timer.charge("draft", t0, t1)
        self.timer.charge("verify", t1, t2)
        self.timer.charge("draft", t2, t3)

    def _drop(self, emitter: _Emitter, keep: list[int]) -> None:
        idx = emitter.select(keep)
        self.target.select_rows(idx, keep)
        self.drafter.select_rows(idx, keep)
        self.roots = self.roots[idx]

    def finish(self, emitter: _Emitter) -> SpecStats:
        stats = self.stats
        stats.new_tokens = emitter.new_tokens
        calls = getattr(self.drafter, "draft_calls", None)
        stats.draft_calls = calls if isinstance(calls, int) else None  # not reported by this drafter
        stats.distortion_total = float(self.distortion)  # SYNC: once, after the loop
        self.timer.charge("total", self.t_start, self.timer.mark())
        totals = self.timer.totals()
        stats.draft_seconds = totals.get("draft", 0.0)
        stats.verify_seconds = totals.get("verify", 0.0)
        stats.total_seconds = totals.get("total", 0.0)
        return stats
