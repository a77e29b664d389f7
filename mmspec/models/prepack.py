"""CPU weight prepacking: run a model's `nn.Linear` layers on oneDNN-prepacked weights.

Why: speculative decoding assumes that verifying K+1 tokens costs about as much as decoding
one (the forward is bound by reading the weights). On CPU, stock `F.linear` breaks that
assumption: for a handful of rows (M = 2..8) the BLAS call repacks the whole weight matrix
on every call, so a 5-token forward of a 50M-parameter Llama costs ~1.5x a 1-token one and
~2x the prepacked kernel. oneDNN's prepacked linear (the kernel PyTorch's own inductor
uses on CPU after weight "freezing"; IPEX does the same) reorders each weight once into
the blocked layout the kernel reads, and then costs about the same at M = 1 and M = 8.

`packed_model(model)` returns a *view* of an HF model: the same module tree and the same
parameter tensors, with every `nn.Linear` replaced by a `PackedLinear` that also holds the
packed copy (the original model is never modified). The packed copy doubles the memory of
the linear weights, so `"auto"` only packs float32 CPU models whose linear weights fit in
`AUTO_BUDGET_BYTES`. A packed copy is rebuilt when its weight changes in place (tracked by
the tensor version counter), so a drafter trained between calls never drafts with stale
weights. Results match `F.linear` to float32 rounding (relative ~1e-6); float64 models
(the exactness tests) are never packed.
"""

from __future__ import annotations

import copy
import weakref

import torch
import torch.nn.functional as F

AUTO_BUDGET_BYTES = 2 << 30  # pack "auto" models whose linear weights take at most 2 GiB
_VIEWS: "weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module]" = weakref.WeakKeyDictionary()


def prepack_available() -> bool:
    """True when this torch build has the oneDNN prepacked-linear kernels."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(torch.nn.Module):
    """`nn.Linear` sharing the original's parameters and computing with a packed copy."""

    def __init__(self, linear: torch.nn.Linear, batch_hint: int = 8):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter object: no copy of the dense weight
        self.bias = linear.bias
        self.batch_hint = batch_hint
        self._packed = None
        self._version = -1
        self._repack()

    def _repack(self) -> None:
        with torch.no_grad():
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), self.batch_hint)
        self._version = self.weight._version

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.dtype != w.dtype or x.device != w.device or w.device.type != "cpu" or torch.is_grad_enabled():
            return F.linear(x, w, self.bias)  # training or moved: the plain kernel, always current
        if w._version != self._version or self._packed.dtype != w.dtype:
            self._repack()  # the weight changed in place since it was packed
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


def _linear_bytes(model: torch.nn.Module) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if type(m) is torch.nn.Linear)


def should_prepack(model: torch.nn.Module, prepack="auto") -> bool:
    """Resolve a `prepack` argument (True, False or "auto") for `model`; True on a model
    that cannot be packed raises a ValueError saying why."""
    if prepack not in (True, False, "auto"):
        raise ValueError(f"prepack must be True, False or 'auto', got {prepack!r}")
    if prepack is False:
        return False
    param = next(model.parameters(), None)
    reasons = []
    if not prepack_available():
        reasons.append("this torch build lacks oneDNN prepacked linear kernels")
    if param is None or param.device.type != "cpu":
        reasons.append("the model is not on the CPU")
    elif param.dtype != torch.float32:
        reasons.append(f"the model is {param.dtype}, prepacking is float32 only")
    if hasattr(model, "_orig_mod") or any(hasattr(m, "_hf_hook") for m in model.modules()):
        reasons.append("the model is compiled or dispatched by accelerate hooks")
    if prepack is True:
        if reasons:
            raise ValueError(f"prepack=True but {'; '.join(reasons)}; pass prepack=False or 'auto'")
        return True
    return not reasons and _linear_bytes(model) <= AUTO_BUDGET_BYTES


def _view(module: torch.nn.Module, memo: dict) -> torch.nn.Module:
    if id(module) in memo:
        return memo[id(module)]
    if type(module) is not torch.nn.Linear:
        new = copy.copy(module)  # shallow: shares parameter tensors, buffers and config
        new._parameters = dict(module._parameters)
        new._buffers = dict(module._buffers)
        for name, value in vars(module).items():
            if name.startswith(("_forward", "_backward", "_state_dict")) and isinstance(value, dict):
                # Own hook dicts: hooks transformers installs later on one (output capturing)
                # must not be installed twice on the other.
                setattr(new, name, type(value)(value))
        new._modules = {}
        memo[id(module)] = new  # before the children: a child may refer back to a shared module
        for name, child in module._modules.items():
            new._modules[name] = None if child is None else _view(child, memo)
        return new
    new = PackedLinear(module)
    memo[id(module)] = new
    return new


def packed_model(model: torch.nn.Module) -> torch.nn.Module:
    """A view of `model` whose `nn.Linear` layers run on prepacked weights (cached per
    model; the model itself is left untouched)."""
    view = _VIEWS.get(model)
    if view is None:
        view = _view(model, {})
        _VIEWS[model] = view
    return view


def maybe_packed(model: torch.nn.Module, prepack="auto") -> torch.nn.Module:
    """`packed_model(model)` when `should_prepack(model, prepack)`, else `model`."""
    return packed_model(model) if should_prepack(model, prepack) else model
