"""Targets must decode in inference mode: a model left in training mode with active dropout
draws a fresh dropout mask at every forward, so its "plain" decoding is itself random and a
verify forward scores drafts under other masks than a one-token step would. Neither greedy
equality nor exact sampling means anything then, so such a target is refused by name
(`model.eval()` is the fix). A model in training mode without active dropout (most recent
LLMs set every dropout to 0) computes what it computes in eval mode and is accepted.
Drafters are not checked: their randomness only changes which drafts are proposed, and
verification keeps the output exact."""

from __future__ import annotations

import contextlib
import threading

import torch


def active_dropout(model: torch.nn.Module) -> str | None:
    """'name (p=...)' of the first submodule that drops units in the model's current mode, or None."""
    if not model.training:
        return None
    for name, module in model.named_modules():
        if not module.training:
            continue
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            if module.p > 0:
                return f"{name or type(model).__name__} (p={module.p})"
            continue
        # attention dropout kept as a float and applied only in training (transformers' attention
        # modules: `attention_dropout`; mmspec's LlamaGen GPT: `attn_dropout_p`)
        for attr in ("attention_dropout", "attn_dropout_p", "dropout"):
            value = module.__dict__.get(attr)
            if isinstance(value, float) and value > 0:
                return f"{name}.{attr} (p={value})"
    return None


def check_eval_mode(model: torch.nn.Module, role: str = "target") -> None:
    where = active_dropout(model)
    if where is not None:
        raise ValueError(
            f"the {role} model ({type(model).__name__}) is in training mode with active dropout at {where}: every "
            "forward would drop other units, so its decoding is random and speculative decoding cannot equal it; "
            "call model.eval() first"
        )


_HELD: dict[int, tuple[int, list]] = {}  # id(module) -> (calls inside, the modes to put back)
_HELD_LOCK = threading.Lock()


@contextlib.contextmanager
def eval_modes(*models: torch.nn.Module | None):
    """Every module of `models` (None skipped) in eval mode inside the block, each put back to
    its own mode after it, also when the block raises (a pipeline called between training steps
    leaves the caller's train / eval modes as they were). Blocks that overlap (calls from two
    threads) share one saved state: the modes come back when the last of them ends."""
    roots = [m for m in models if m is not None]
    bad = [type(m).__name__ for m in roots if not isinstance(m, torch.nn.Module)]
    if bad:
        raise TypeError(f"eval_modes takes torch.nn.Module objects (or None), got {', '.join(bad)}")
    with _HELD_LOCK:  # (no exception between here and the try: Module objects only)
        for root in roots:
            count, saved = _HELD.get(id(root), (0, None))
            if count == 0:
                saved = [(m, m.training) for m in root.modules()]
                for m, _ in saved:
                    m.training = False
            _HELD[id(root)] = (count + 1, saved)
    try:
        yield
    finally:
        with _HELD_LOCK:
            for root in reversed(roots):  # (a module shared by two roots gets its first root's saved mode)
                count, saved = _HELD.pop(id(root))
                if count > 1:
                    _HELD[id(root)] = (count - 1, saved)
                else:  # per module: a model may keep some parts in eval mode on purpose
                    for m, mode in saved:
                        m.training = mode
