"""`GuidedModelDrafter`: a model drafter that drafts under classifier-free guidance.

What: `mmspec.GuidedTarget` verifies with guided logits `u + s * (c - u)`; a drafter that
drafts from its conditional logits alone proposes tokens of another distribution and gets
rejected more often. This drafter is a `ModelDrafter` (chains and EAGLE-2 trees) whose runner
holds a doubled batch, conditional rows `[0, B)` and unconditional rows `[B, 2B)` (built by
`make_uncond`, e.g. LlamaGen's null class), runs both halves in the same drafter forward and
hands the drafting code the guided logits, with the same scale or schedule as the target.
Both halves advance, roll back and leave the batch together (the same scheme as
`GuidedTarget`, applied to the drafter's own ragged cache). The CFG form is LlamaGen's (Sun et
al. 2024, arXiv 2406.06525; github.com/FoundationVision/LlamaGen,
`autoregressive/models/generate.py`).

The schedule receives the index of the token being predicted (0 = the first new token),
derived from the logical positions of the drafter's queries: index = position - prompt
length + 1, the same index `GuidedTarget` passes.

Limits: doubles the drafter's compute (as CFG doubles the target's); drafter model inputs
other than token ids are not used (as `ModelDrafter`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from mmspec.guided import uncond_prompts
from mmspec.sampling import plain_number
from mmspec.spec import SpecOutput, SpecRunner
from mmspec.types import TreeConfig

from .model_drafter import ModelDrafter


class _GuidedRunner:
    """A `SpecRunner` look-alike over a doubled batch that returns guided logits."""

    def __init__(self, inner: SpecRunner, schedule: Callable, make_uncond: Callable):
        self.inner = inner
        self.spec = inner.spec
        self.schedule = schedule
        self.make_uncond = make_uncond
        self.prompt_len: torch.Tensor | None = None  # [B] logical prompt length of the conditional rows
        self.uncond: tuple[torch.Tensor, torch.Tensor] | None = None  # the request's unconditional (ids, mask)

    def take_uncond(self, input_ids, attention_mask, model_inputs: dict[str, Any]) -> None:
        """Build the unconditional prompts when the request starts, with every row: an adaptive
        drafter runs its prompt prefill later (the first step that drafts), when rows that ended
        have left, and a `make_uncond` holding per-row prompts would not match them then."""
        u_ids, u_mask, _ = uncond_prompts(self.make_uncond, input_ids, attention_mask, model_inputs)
        if u_ids.dim() != 2 or u_ids.shape != input_ids.shape:
            raise ValueError("GuidedModelDrafter: unconditional prompts must have the conditional prompts' shape "
                             f"{tuple(input_ids.shape)} (one per row, the same length), got {tuple(u_ids.shape)}")
        self.uncond = (u_ids, u_mask.to(attention_mask.dtype))

    @property
    def kv(self):
        return self.inner.kv

    def _guide(self, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        B = logits.shape[0] // 2
        cond, uncond = logits[:B], logits[B:]
        scale = self.schedule(index)
        if isinstance(scale, torch.Tensor):
            scale = scale.to(cond.dtype).unsqueeze(-1)
        return uncond + scale * (cond - uncond)

    def prefill(self, input_ids, attention_mask, max_slots: int, model_inputs: dict[str, Any], features=None):
        B = input_ids.shape[0]
        if self.uncond is None:  # (a runner used on its own)
            self.take_uncond(input_ids, attention_mask, model_inputs)
        u_ids, u_mask = self.uncond  # the request's rows still running (take_uncond, select_rows)
        self.uncond = None
        out = self.inner.prefill(torch.cat([input_ids, u_ids]), torch.cat([attention_mask, u_mask]),
                                 max_slots, {}, features)
        self.prompt_len = attention_mask.long().sum(1)
        index = torch.zeros(B, 1, dtype=torch.long, device=input_ids.device)
        return SpecOutput(logits=self._guide(out.logits, index))

    def forward(self, tokens, depth, tree_visible, uncommitted: int, *, last_only: bool | int = False,
                queries: int | None = None, sees_region: bool = False) -> SpecOutput:
        B = tokens.shape[0]
        q_pos = self.inner.kv.next_pos[:B].unsqueeze(1) + depth  # logical positions of the conditional queries
        out = self.inner.forward(torch.cat([tokens, tokens]), torch.cat([depth, depth]),
                                 torch.cat([tree_visible, tree_visible]), uncommitted, last_only=last_only,
                                 queries=queries, sees_region=sees_region)
        index = q_pos - self.prompt_len.unsqueeze(1) + 1
        if last_only:  # True: the last query; an int n: the last n
            index = index[:, -int(last_only):]
        return SpecOutput(logits=self._guide(out.logits, index))

    def advance(self, counts: torch.Tensor, counts_host: list[int], path: torch.Tensor | None = None) -> None:
        self.inner.advance(torch.cat([counts, counts]), counts_host + counts_host,
                           None if path is None else torch.cat([path, path]))

    def select_rows(self, rows: torch.Tensor, rows_host: list[int]) -> None:
        B = self.inner.kv.batch_size // 2
        self.inner.select_rows(torch.cat([rows, rows + B]), rows_host + [r + B for r in rows_host])
        self.prompt_len = self.prompt_len.index_select(0, rows)


class GuidedModelDrafter(ModelDrafter):
    """`ModelDrafter(model, num_draft_tokens, tree)` drafting from guided logits (`num_draft_tokens=
    "auto"` as for `ModelDrafter`: K chosen before every step). `guidance_scale`
    is a number or a schedule callable (as `GuidedTarget` takes it); `make_uncond(input_ids,
    attention_mask, model_inputs) -> (ids, mask, model_inputs)` builds the unconditional prompts
    (same shape as the conditional ones), once, when a request starts (with all its rows, as
    `GuidedTarget` calls it), even where the drafter's prompt prefill waits for its first
    drafting step."""

    def __init__(self, model, guidance_scale, num_draft_tokens: int | str | None = None, tree: TreeConfig | None = None, *,
                 make_uncond: Callable, max_draft_tokens: int | None = None, prepack="auto"):
        # (None: 4 for a chain; beside a tree ModelDrafter refuses any value by name)
        if num_draft_tokens is None and tree is None:
            num_draft_tokens = 4
        super().__init__(model, num_draft_tokens, tree, max_draft_tokens=max_draft_tokens, prepack=prepack)
        guidance_scale = plain_number(guidance_scale)  # (np.float32(2.0) means 2.0)
        if callable(guidance_scale):
            schedule = guidance_scale
        else:
            if isinstance(guidance_scale, bool) or not isinstance(guidance_scale, (int, float)) or not math.isfinite(
                guidance_scale
            ):
                raise ValueError(f"guidance_scale must be a finite number or a schedule callable, got {guidance_scale!r}")
            scale = float(guidance_scale)
            schedule = lambda index: scale  # noqa: E731
        if not callable(make_uncond):
            raise TypeError("GuidedModelDrafter needs make_uncond(input_ids, attention_mask, model_inputs)")
        self.runner = _GuidedRunner(self.runner, schedule, make_uncond)

    def prefill(self, input_ids, attention_mask, target_out, model_inputs: dict[str, Any], max_new_tokens: int):
        self.runner.take_uncond(input_ids, attention_mask, model_inputs)
        super().prefill(input_ids, attention_mask, target_out, model_inputs, max_new_tokens)

    def select_rows(self, rows: torch.Tensor, rows_host: list[int]) -> None:
        if self.runner.uncond is not None:  # the prompt prefill is still deferred: its rows leave too
            self.runner.uncond = tuple(t.index_select(0, rows) for t in self.runner.uncond)
        super().select_rows(rows, rows_host)
