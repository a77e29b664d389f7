"""`GuidedTarget`: classifier-free guidance (CFG) as a wrapper around any `mmspec.Target`.

The inner target holds a doubled batch: rows `[0, B)` are the conditional prompts, rows
`[B, 2B)` the unconditional ones. Both halves verify the same draft tokens in the same
forward, the guided logits `uncond + s * (cond - uncond)` (Ho & Salimans 2022; the form used
by LlamaGen and Janus) are what the loop sees, so temperature / top-k / top-p apply *after*
guidance, exactly as in the models' own samplers. `commit` and `select_rows` are mirrored to
both halves, so the halves roll back together and leave the batch together.

`guidance_scale` is a number or a schedule: a callable mapping the index of the token being
predicted (`[B, Q]` long, 0 = the first new token) to the scale (`[B, Q]` float or a number),
which covers LlamaGen's constant and linear CFG schedules.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from mmspec.types import CommitInfo, FeatureRequest, TargetOutput

UncondBuilder = Callable[[torch.Tensor, torch.Tensor, dict], tuple[torch.Tensor, torch.Tensor, dict]]


def _placeholders_at(ids: torch.Tensor, mask: torch.Tensor, token_ids) -> torch.Tensor:
    """[B, L] bool: the real (unmasked) tokens of `ids` that are one of `token_ids`."""
    wanted = torch.tensor(list(token_ids), dtype=ids.dtype, device=ids.device)
    return (ids[..., None] == wanted).any(-1) & (mask.to(ids.device) != 0)


def _left_pad(ids: torch.Tensor, mask: torch.Tensor, length: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    extra = length - ids.shape[1]
    if extra == 0:
        return ids, mask
    return (
        torch.cat([ids.new_full((ids.shape[0], extra), pad_id), ids], 1),
        torch.cat([mask.new_zeros(mask.shape[0], extra), mask], 1),
    )


# Model inputs with one entry per image / video (not per prompt row): an unconditional half may have none
# (make_uncond returns None), the conditional rows' entries then standing alone.
PER_IMAGE_INPUTS = frozenset({"pixel_values", "pixel_values_videos", "image_sizes", "image_grid_thw",
                              "video_grid_thw", "second_per_grid_ts"})


class GuidedTarget:
    """CFG over `target`. The unconditional prompts come from `uncond_input_ids` /
    `uncond_attention_mask` (one row per conditional row, left-padded; without a mask every
    unconditional token is taken as real, `pad_token_id` included: pass the tokenizer's mask) or from
    `make_uncond(input_ids, attention_mask, model_inputs) -> (ids, mask, model_inputs)`
    (e.g. LlamaGen: the null class). Tensor model inputs with a batch dimension are
    concatenated [cond; uncond] (by default the uncond half reuses the cond inputs; its
    prompts must then hold the same image / video placeholder tokens, refused by name if not).
    `make_uncond` may return an input as None: the uncond half has none of it (e.g. text-only
    unconditional prompts on a VLM: `{"pixel_values": None}`, prompts without image tokens).
    A VLM's image features (flattened per image token) are split between the halves by those
    placeholders."""

    def __init__(
        self,
        target,
        guidance_scale: float | Callable[[torch.Tensor], Any],
        *,
        uncond_input_ids: torch.Tensor | None = None,
        uncond_attention_mask: torch.Tensor | None = None,
        make_uncond: UncondBuilder | None = None,
        pad_token_id: int = 0,
    ):
        from mmspec.engine import as_target  # the engine wraps bare HF models the same way

        from mmspec.sampling import plain_number

        if (uncond_input_ids is None) == (make_uncond is None):
            raise ValueError("GuidedTarget needs exactly one of uncond_input_ids or make_uncond")
        if make_uncond is not None and not callable(make_uncond):
            raise TypeError(f"make_uncond must be a callable (input_ids, attention_mask, model_inputs) -> (ids, mask, "
                            f"model_inputs), got {type(make_uncond).__name__}")
        if uncond_input_ids is not None and (not isinstance(uncond_input_ids, torch.Tensor)
                                             or uncond_input_ids.is_floating_point() or uncond_input_ids.dim() != 2):
            raise TypeError("uncond_input_ids must be a 2-D integer tensor [B, L'] (one unconditional prompt per row)")
        if uncond_attention_mask is not None and uncond_input_ids is None:  # make_uncond returns its own mask
            raise ValueError("uncond_attention_mask goes with uncond_input_ids; make_uncond returns the "
                             "unconditional mask itself")
        guidance_scale, pad_token_id = plain_number(guidance_scale), plain_number(pad_token_id)  # (np.float32(2.0))
        if callable(guidance_scale):
            self.schedule = guidance_scale
        else:
            if isinstance(guidance_scale, bool) or not isinstance(guidance_scale, (int, float)) or not math.isfinite(
                guidance_scale
            ):
                raise ValueError(f"guidance_scale must be a finite number or a schedule callable, got {guidance_scale!r}")
            scale = float(guidance_scale)
            self.schedule = lambda index: scale
        self.target = as_target(target)
        self.vocab_size = self.target.vocab_size
        if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or not 0 <= pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id must be a token id in [0, {self.vocab_size}) (it pads the shorter of the "
                             f"conditional and unconditional prompts), got {pad_token_id!r}")
        # A position table (GPT-2's) bounds the conditional rows through the loop's own check; the
        # unconditional rows, whose prompts may be longer, are checked at prefill.
        self.max_positions = getattr(self.target, "max_positions", None)
        self.max_output_tokens = getattr(self.target, "max_output_tokens", None)
        self.supports_features = getattr(self.target, "supports_features", False)
        self.uncond_input_ids = uncond_input_ids
        self.uncond_attention_mask = uncond_attention_mask
        self.make_uncond = make_uncond
        self.pad_token_id = pad_token_id
        self.generated: torch.Tensor | None = None  # [B] tokens emitted so far per row (root included)

    @property
    def stop_requested(self) -> bool:
        """The wrapped target's optional stop request, passed through (mmspec/protocols.py)."""
        return bool(getattr(self.target, "stop_requested", False))

    # ---- guidance ------------------------------------------------------------------------------
    def _guide(self, out: TargetOutput, index: torch.Tensor, image_split: int | None = None) -> TargetOutput:
        """Guided logits, and each half's features. `image_split`: the prefill's image features
        come flattened per image token ([tokens, H], the conditional rows' first), not per row."""
        B = out.logits.shape[0] // 2
        cond, uncond = out.logits[:B], out.logits[B:]
        scale = self.schedule(index)
        if isinstance(scale, torch.Tensor):
            scale = scale.to(cond.dtype).unsqueeze(-1)  # [B, Q, 1]
        guided = uncond + scale * (cond - uncond)

        def half(sl, image_sl) -> TargetOutput:
            return TargetOutput(
                logits=out.logits[sl],
                hidden_states=None if out.hidden_states is None else out.hidden_states[sl],
                layer_states={i: h[sl] for i, h in out.layer_states.items()},
                image_features=None if out.image_features is None else out.image_features[image_sl],
                positions=None if out.positions is None else out.positions[..., sl, :],
            )

        split = B if image_split is None else image_split
        result = half(slice(0, B), slice(0, split))
        result.logits = guided
        result.uncond = half(slice(B, 2 * B), slice(split, None))
        return result

    def acceptance_tables(self) -> dict:
        """The wrapped target's tables (VQ codebook, token embeddings) for rules named by string."""
        provide = getattr(self.target, "acceptance_tables", None)
        return provide() if callable(provide) else {}

    # ---- Target protocol ------------------------------------------------------------------------
    def check_inputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, model_inputs: dict[str, Any]) -> None:
        """The wrapped target's check of the conditional rows' model inputs (no forward)."""
        check = getattr(self.target, "check_inputs", None)
        if callable(check):
            check(input_ids, attention_mask, model_inputs)

    def prefill(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        model_inputs: dict[str, Any],
        max_new_tokens: int,
        max_draft_nodes: int,
        features: FeatureRequest = FeatureRequest(),
    ) -> TargetOutput:
        B = input_ids.shape[0]
        if self.make_uncond is not None:
            u_ids, u_mask, u_inputs = uncond_prompts(self.make_uncond, input_ids, attention_mask, model_inputs)
        else:
            u_ids = self.uncond_input_ids.to(input_ids.device)
            u_mask = torch.ones_like(u_ids) if self.uncond_attention_mask is None else self.uncond_attention_mask
            u_inputs = model_inputs
        if u_ids.dim() != 2 or u_ids.shape[0] != B:
            raise ValueError(f"unconditional prompts must be [B={B}, L'] (one per row), got {tuple(u_ids.shape)}")
        from mmspec.engine import check_attention_mask  # the loop's own check (a wrong shape failed deep in the forward)

        u_mask = check_attention_mask(u_mask.to(u_ids.device) if isinstance(u_mask, torch.Tensor) else u_mask, u_ids,
                                      "the unconditional attention mask", "the unconditional prompts")
        need = u_ids.shape[1] + max_new_tokens - 1 + max_draft_nodes
        if self.max_positions is not None and u_ids.shape[1] > input_ids.shape[1] and need > self.max_positions:
            raise ValueError(
                f"the unconditional prompts ({u_ids.shape[1]} tokens) + max_new_tokens {max_new_tokens} + up to "
                f"{max_draft_nodes} draft positions may need {need} positions, more than the target's position table "
                f"holds ({self.max_positions}); shorten the unconditional prompts or lower max_new_tokens"
            )
        placeholders = getattr(self.target, "placeholder_token_ids", None) or {}  # optional (HFTarget: a VLM's)
        every = [t for ids in placeholders.values() for t in ids]
        unknown = [name for name in u_inputs if name not in model_inputs]
        if unknown:  # (they were dropped without a word)
            raise ValueError(f"make_uncond returned model inputs {unknown} that the conditional rows do not have; both "
                             "halves run in one forward, so give them to the request too or leave them out")
        # Per input: the conditional tensor itself (not returned, or returned as is), or None (the
        # unconditional half has none of it: e.g. no images).
        reused = [name for name, v in model_inputs.items() if u_inputs.get(name, v) is v]
        absent = [name for name in model_inputs if name in u_inputs and u_inputs[name] is None]
        if every and (reused or absent):
            per_row = [_placeholders_at(ids, mask, every).sum(1) for ids, mask in
                       ((input_ids, attention_mask), (u_ids, u_mask))]
            if reused and not torch.equal(per_row[0], per_row[1].to(per_row[0].device)):  # SYNC: prefill check
                raise ValueError(
                    f"the unconditional prompts hold {per_row[1].tolist()} image / video placeholder tokens per row "
                    f"where the conditional ones hold {per_row[0].tolist()}, but the unconditional half reuses the "
                    f"conditional {', '.join(map(repr, reused))}; GuidedTarget needs the same placeholders in both "
                    "halves (keep them in the unconditional prompts), or make_uncond must return that half's own "
                    "model inputs (None for one it has none of)"
                )
            if absent and not reused and bool(per_row[1].any()):
                raise ValueError(
                    f"make_uncond returned None for {', '.join(map(repr, absent))} (none for the unconditional half), "
                    f"but the unconditional prompts hold {per_row[1].tolist()} image / video placeholder tokens per "
                    "row; take the placeholders out of those prompts, or return that half's own inputs"
                )
        Lc, Lu = input_ids.shape[1], u_ids.shape[1]
        L = max(Lc, Lu)
        c_ids, c_mask = _left_pad(input_ids, attention_mask, L, self.pad_token_id)
        u_ids, u_mask = _left_pad(u_ids, u_mask.to(attention_mask.dtype), L, self.pad_token_id)
        inputs = {}
        for name, value in model_inputs.items():
            other = u_inputs.get(name, value)
            if name not in PER_IMAGE_INPUTS and isinstance(value, torch.Tensor) and value.dim() == 2 and (
                    not value.is_floating_point() and value.shape == input_ids.shape):
                # Per prompt token (token_type_ids, ...): it follows each half's own prompt, left-padded with it.
                if other is None or (other is value and (Lu != Lc or not torch.equal(
                        input_ids.masked_fill(attention_mask == 0, -1).cpu(),
                        u_ids.masked_fill(u_mask == 0, -1).cpu()))):  # (equal lengths: nothing was padded)
                    why = ("None cannot stand for it (each unconditional prompt token needs its entry)" if other is None
                           else f"the unconditional prompts {'differ' if Lu == Lc else f'have {Lu} tokens'}, so "
                                "reusing it would misalign it")
                    raise ValueError(f"model input {name!r} [B, {Lc}] follows the conditional prompts token by token; "
                                     f"{why}: make_uncond must return that half's own {name!r} [B, {Lu}]")
                if not isinstance(other, torch.Tensor) or tuple(other.shape) != (B, Lu):
                    raise ValueError(f"make_uncond returned model input {name!r} as {type(other).__name__} "
                                     f"{tuple(getattr(other, 'shape', ()))}; it must be a tensor [{B}, {Lu}] (one "
                                     "entry per unconditional prompt token)")
                pad = lambda t: torch.cat([t.new_zeros(B, L - t.shape[1]), t], 1)  # noqa: E731
                inputs[name] = torch.cat([pad(value), pad(other.to(value.device))], 0)
                continue
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == B:
                if other is None and name not in PER_IMAGE_INPUTS:
                    raise ValueError(
                        f"make_uncond returned None for model input {name!r}; None (none for the unconditional "
                        f"half) is for per-image inputs ({', '.join(sorted(PER_IMAGE_INPUTS))}): return that half's "
                        f"own {name!r}"
                    )
                if other is None:  # the unconditional rows have none of it (checked above for placeholders)
                    inputs[name] = value
                elif not isinstance(other, torch.Tensor) or other.shape[1:] != value.shape[1:]:
                    raise ValueError(
                        f"make_uncond returned model input {name!r} as {type(other).__name__} "
                        f"{tuple(getattr(other, 'shape', ()))}; it must be None or a tensor [n, "
                        f"{', '.join(map(str, value.shape[1:]))}] like the conditional rows' {tuple(value.shape)}"
                    )
                else:
                    inputs[name] = torch.cat([value, other.to(value.device)], 0)
            else:
                raise ValueError(
                    f"model input {name!r} has no batch dimension of size {B}; GuidedTarget cannot split it into "
                    "conditional and unconditional halves"
                )
        out = self.target.prefill(
            torch.cat([c_ids, u_ids]), torch.cat([c_mask, u_mask]), inputs, max_new_tokens, max_draft_nodes, features
        )
        self.generated = torch.ones(B, dtype=torch.long, device=input_ids.device)
        image_split = None
        if out.image_features is not None:
            # A VLM's features come flattened per image token, in row order (the conditional rows'
            # tokens first); other targets' per row.
            images = placeholders.get("image", [])
            tokens = _placeholders_at(torch.cat([c_ids, u_ids]), torch.cat([c_mask, u_mask]), images)
            if images and int(tokens.sum()) == out.image_features.shape[0]:  # SYNC: prefill
                image_split = int(tokens[:B].sum())
            elif out.image_features.shape[0] != 2 * B:
                raise ValueError(
                    f"the target returned {out.image_features.shape[0]} image features for {2 * B} rows and GuidedTarget "
                    f"cannot tell which belong to the conditional half (it counts the target's image placeholder "
                    f"tokens, {placeholders.get('image', [])}); run the image-feature drafter without guidance"
                )
        result = self._guide(out, torch.zeros(B, 1, dtype=torch.long, device=input_ids.device), image_split)
        extra = L - input_ids.shape[1]
        if extra:  # longer unconditional prompts padded the conditional rows: the drafter's features
            # must line up with the input_ids it was given (the padding added columns at the front)
            result.hidden_states = None if result.hidden_states is None else result.hidden_states[:, extra:]
            result.layer_states = {i: h[:, extra:] for i, h in result.layer_states.items()}
            result.positions = None if result.positions is None else result.positions[..., extra:]
        return result

    def verify(self, tokens: torch.Tensor, parents: torch.Tensor | None) -> TargetOutput:
        from mmspec.spec_target import tree_visibility

        B, Q = tokens.shape
        doubled_parents = None if parents is None else torch.cat([parents, parents])
        out = self.target.verify(torch.cat([tokens, tokens]), doubled_parents)
        _, depth = tree_visibility(parents, B, Q, tokens.device)
        # The root is emitted token `generated - 1`; position j (depth d) predicts token `generated + d`.
        return self._guide(out, self.generated.unsqueeze(1) + depth)

    def commit(self, info: CommitInfo) -> None:
        self.target.commit(
            CommitInfo(
                path=torch.cat([info.path, info.path]),
                num_accepted=torch.cat([info.num_accepted, info.num_accepted]),
                accepted_tokens=torch.cat([info.accepted_tokens, info.accepted_tokens]),
                next_tokens=torch.cat([info.next_tokens, info.next_tokens]),
                num_accepted_list=info.num_accepted_list + info.num_accepted_list,
                is_chain=info.is_chain,
            )
        )
        self.generated = self.generated + info.num_accepted + 1

    def select_rows(self, rows: torch.Tensor, rows_host: list[int]) -> None:
        B = self.generated.shape[0]
        self.target.select_rows(torch.cat([rows, rows + B]), rows_host + [r + B for r in rows_host])
        self.generated = self.generated.index_select(0, rows)


def uncond_prompts(make_uncond, input_ids, attention_mask, model_inputs):
    """Call `make_uncond` and check what it returned: (ids: an integer tensor, mask: a tensor,
    model inputs: a dict). A callback that breaks the contract is named, where Python's
    unpacking errors named nothing. (The ids' range is the target's to check: a class-conditional
    GPT's prompt is a class id, its null class past the token vocabulary.)"""
    out = make_uncond(input_ids, attention_mask, model_inputs)
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise TypeError(f"make_uncond must return (input_ids, attention_mask, model_inputs), got {type(out).__name__}"
                        + (f" of {len(out)}" if isinstance(out, (tuple, list)) else ""))
    ids, mask, inputs = out
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or not isinstance(mask, torch.Tensor):
        raise TypeError("make_uncond must return integer token ids and an attention mask as tensors, got "
                        f"{type(ids).__name__} and {type(mask).__name__}")
    if not isinstance(inputs, dict):
        raise TypeError(f"make_uncond must return the model inputs as a dict, got {type(inputs).__name__}")
    return ids, mask, inputs
