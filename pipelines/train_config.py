"""`TrainDrafterConfig`: the options of `mmspec train-drafter` (no heavy imports, so the CLI
can build its parser from the fields without loading torch)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mmspec.devices import check_device

KINDS = ("text", "eagle", "vispec", "flash")
LR_SCHEDULES = ("constant", "cosine")


def lr_at(config: "TrainDrafterConfig", step: int) -> float:
    """Learning rate of 0-based optimiser step `step`: a linear warm-up over `warmup_steps`, then
    `lr` held ("constant") or decayed along a half cosine toward 0, reached at `steps` ("cosine": the
    last step, `steps - 1`, still trains at a small positive rate)."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / (config.warmup_steps + 1)
    if config.lr_schedule == "constant":
        return config.lr
    done = (step - config.warmup_steps) / max(config.steps - config.warmup_steps, 1)
    return config.lr * 0.5 * (1.0 + math.cos(math.pi * min(done, 1.0)))


# `mmspec train-drafter --help`: one line per option (every field but `progress`, which is
# `--no-progress`); a test checks that each field has one.
HELP = {
    "pipeline": "saved SpeculativeVLMPipeline folder whose target is distilled (e.g. assets/testbed/vlm)",
    "drafter": f"drafter kind: one of {', '.join(KINDS)}",
    "out": "folder for the trained drafter (config + safetensors), its checkpoint and train_log.jsonl",
    "data": "folder of images (+ optional scenes.jsonl) to regenerate answers on; default: testbed scenes",
    "num_images": "images whose answers the target regenerates as training data (with --data: at most that many of "
                  "the folder's images) (default %(default)s)",
    "answer_tokens": "max new tokens of each regenerated answer (default %(default)s)",
    "steps": "optimiser steps (default %(default)s); a run in --out resumes from its checkpoint",
    "batch_size": "examples per step, at most the number of examples (default %(default)s)",
    "grad_accum": "gradient-accumulation micro-batches per step (default %(default)s)",
    "lr": "peak learning rate of AdamW (default %(default)s)",
    "lr_schedule": "constant, or cosine (a half cosine toward 0, reached at --steps) (default %(default)s)",
    "warmup_steps": "linear warm-up steps before the schedule (default %(default)s)",
    "ttt_steps": "extra unrolled forwards on the head's own features, training-time test (default 1; 0 for flash, "
                 "whose head never reads its own features)",
    "feature_weight": "eagle / vispec / flash: weight of the SmoothL1 loss on the target's features (default %(default)s)",
    "ce_weight": "eagle / vispec / flash: weight of the cross-entropy against the target's tokens (default %(default)s; a text drafter trains on the cross-entropy alone)",
    "text_layers": "decoder layers of the text drafter's small LM (default %(default)s)",
    "slots": "flash: tokens the head drafts per forward, the most a step drafts (default %(default)s)",
    "compress_len": "flash: tokens each image span is pooled into, at most its image tokens (default %(default)s)",
    "num_draft_tokens": "chain length K saved with the drafter, or auto (chosen per request by measured speed) "
                        "(default 4; flash: its --slots)",
    "tree_depth": "> 0: save the drafter with a dynamic tree of this depth (default %(default)s: chains)",
    "tree_top_k": "tree: children kept per node (default %(default)s)",
    "tree_num_nodes": "tree: nodes verified per step, or auto (chosen per request by measured speed) (default %(default)s)",
    "device": "cpu or cuda[:N] (default %(default)s)",
    "bf16": "train in bfloat16 autocast (CUDA only)",
    "save_every": "steps between checkpoints (default %(default)s)",
    "seed": "seed of data order, initialisation and regenerated scenes (default %(default)s)",
}


@dataclass(frozen=True)
class TrainDrafterConfig:
    pipeline: str
    drafter: str
    out: str
    data: str | None = None  # folder of images (+ scenes.jsonl); None = testbed scenes
    num_images: int = 64
    answer_tokens: int = 32  # max new tokens of the regenerated answers
    steps: int = 200
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 3e-4
    lr_schedule: str = "constant"  # or "cosine": decays to 0 at `steps`
    warmup_steps: int = 0  # linear warm-up from 0 before the schedule
    ttt_steps: int | None = None  # extra unrolled forwards on the head's own features (None: 1; flash 0)
    feature_weight: float = 1.0
    ce_weight: float = 0.1
    text_layers: int = 1  # text drafter: decoder layers of the small LM
    slots: int = 4  # flash: tokens drafted per head forward
    compress_len: int = 8  # flash: pooled tokens per image span
    num_draft_tokens: int | str | None = None  # or "auto" (None: 4; flash: slots)
    tree_depth: int = 0  # > 0: save the drafter with a dynamic tree of this depth
    tree_top_k: int = 4
    tree_num_nodes: int | str = 16  # or "auto"
    device: str = "cpu"
    bf16: bool = False
    save_every: int = 50
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.drafter not in KINDS:
            raise ValueError(f"--drafter must be one of {KINDS}, got {self.drafter!r}")
        for name in ("num_images", "answer_tokens", "steps", "batch_size", "grad_accum", "save_every", "text_layers",
                     "slots", "compress_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        flash = self.drafter == "flash"
        if self.num_draft_tokens is None:  # frozen: the resolved defaults are set once, here
            object.__setattr__(self, "num_draft_tokens", self.slots if flash else 4)
        if self.ttt_steps is None:
            object.__setattr__(self, "ttt_steps", 0 if flash else 1)
        if flash and self.ttt_steps:  # the unroll feeds the head its own features; FLASH's never reads them
            raise ValueError(f"--ttt-steps {self.ttt_steps}: a flash head never reads its own features at inference "
                             "(placeholders come from the root's input), so the unroll would train it on inputs it "
                             "never sees; use --ttt-steps 0")
        k = self.num_draft_tokens  # checked when the drafter was saved: after every training step
        if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"num_draft_tokens must be an int >= 1 or 'auto', got {k!r}")
        if self.tree_depth and k != 4:  # (4: the default) a tree drafts tree_num_nodes
            raise ValueError(f"--num-draft-tokens {k} has no effect with --tree-depth {self.tree_depth} (a tree drafts "
                             "--tree-num-nodes nodes): leave it out")
        if self.drafter == "flash" and (self.tree_depth or (k != "auto" and k > self.slots)):
            raise ValueError(f"a flash drafter drafts chains of at most --slots={self.slots} tokens: got "
                             f"--num-draft-tokens {k} and --tree-depth {self.tree_depth}; pass --num-draft-tokens "
                             f"<= {self.slots} (or leave it out: the slots) and no tree")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"--lr-schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"warmup_steps must be in [0, steps={self.steps}), got {self.warmup_steps}")
        if self.ttt_steps < 0:
            raise ValueError(f"ttt_steps must be >= 0, got {self.ttt_steps}")
        if not (math.isfinite(self.lr) and self.lr > 0):  # torch's optimiser said "Invalid learning rate" after the data stage
            raise ValueError(f"--lr must be a finite number > 0, got {self.lr}")
        # A negative weight trained the drafter to *increase* that loss; two zeros trained nothing.
        weights = (self.feature_weight, self.ce_weight)
        if not all(math.isfinite(w) and w >= 0 for w in weights) or (self.drafter != "text" and not any(w > 0 for w in weights)):
            raise ValueError(f"--feature-weight and --ce-weight must be finite, >= 0 and not both 0, got "
                             f"{self.feature_weight} and {self.ce_weight}")
        check_device(self.device, "--device")  # before the target is loaded and answers regenerated
        if self.bf16 and not self.device.startswith("cuda"):
            raise ValueError("bf16 training needs --device cuda")
        if self.tree_depth:  # the saved tree, checked before any training (TypeError / ValueError by field)
            from mmspec.types import TreeConfig

            TreeConfig(self.tree_depth, self.tree_top_k, self.tree_num_nodes)
