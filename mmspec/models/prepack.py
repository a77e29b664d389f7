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
the tensor version counter and data pointer), so a drafter trained between calls never
drafts with stale weights. Edits through `p.data` (`p.data.mul_`, an EMA's `p.data.copy_`)
bypass the version counter and are not seen: call `repack(model)` after them. Only plain
`nn.Linear` layers are packed (`packable`): one carrying other state (weight_norm's weight_g,
spectral_norm's buffers, a LoRA-style extra tensor or child) runs its own stock forward. The view never goes stale in structure either: every
`packed_model` / `maybe_packed` / `refresh` call compares a fingerprint of the model (its
modules, their attributes, parameters, buffers, hooks and training flags) with the one the
view was built from and rebuilds the view in place when they differ (hooks added or removed,
a replaced `lm_head`, `resize_token_embeddings`, `load_state_dict(..., assign=True)`,
`.eval()` after a call in train mode). The check walks the module tree in Python; a model
changed *during* a generate call is not followed until the next one. Results match `F.linear` to float32 rounding (relative ~1e-6); float64 models
(the exactness tests) are never packed, nor are models whose linear layers mix dtypes or whose
weights were made under `torch.inference_mode()` (no version counter to follow edits by).
Views are kept per model and kernel policy: two wraps of one model with different `prepack`
settings each run their own (they share the packed copies of unchanged weights).
"""

from __future__ import annotations

import copy
import weakref

import torch
import torch.nn.functional as F

from mmspec.versions import version_of

AUTO_BUDGET_BYTES = 2 << 30  # pack "auto" models whose linear weights take at most 2 GiB


def prepack_available() -> bool:
    """True when this torch build has the oneDNN prepacked-linear kernels."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(torch.nn.Module):
    """`nn.Linear` sharing the original's parameters (and carrying copies of its hooks and
    training flag) and computing with a packed copy of its weight."""

    def __init__(self, linear: torch.nn.Linear, batch_hint: int = 8, reuse: "PackedLinear | None" = None,
                 policy=None):
        super().__init__()
        self.policy = policy  # None: always the packed kernel; else a KernelPolicy choosing by row count
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter object: no copy of the dense weight
        self.bias = linear.bias
        self.training = linear.training
        _copy_hooks(linear, self)
        self.batch_hint = batch_hint
        if reuse is not None and reuse.weight is linear.weight and reuse.batch_hint == batch_hint:
            # A rebuilt view keeps the packed copy of an unchanged weight (forward still checks it).
            self._packed, self._version, self._ptr = reuse._packed, reuse._version, reuse._ptr
        else:
            self._packed, self._version, self._ptr = None, -1, -1
            self._repack()

    def _repack(self) -> None:
        with torch.no_grad():
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), self.batch_hint)
        self._version = version_of(self.weight)  # None (never matched): an inference tensor, never packed
        self._ptr = self.weight.data_ptr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (
            x.dtype != w.dtype or w.dtype != torch.float32 or x.device != w.device or w.device.type != "cpu"
            or torch.is_grad_enabled() or w.is_inference()
        ):
            return F.linear(x, w, self.bias)  # training, moved or converted: the plain kernel, always current
        policy = self.policy
        if policy is not None and not policy.use_packed(x.numel() // self.in_features):
            return F.linear(x, w, self.bias)  # the stock kernel measured faster at this row count
        if w._version != self._version or w.data_ptr() != self._ptr:
            self._repack()  # the weight changed in place (or its .data was swapped) since it was packed
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


def _linear_bytes(model: torch.nn.Module) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if packable(m))


def should_prepack(model: torch.nn.Module, prepack="auto") -> bool:
    """Resolve a `prepack` argument (True, False or "auto") for `model`; True on a model
    that cannot be packed raises a ValueError saying why."""
    # by type, not by equality: 1 == True and 0 == False, and a 0 taken as "auto" would prepack
    if not (isinstance(prepack, bool) or (isinstance(prepack, str) and prepack == "auto")):
        raise ValueError(f"prepack must be True, False or 'auto', got {prepack!r}")
    if prepack is False:
        return False
    param = next(model.parameters(), None)
    linears = [(name, m.weight) for name, m in model.named_modules() if _plain_linear(m)]
    reasons = []
    if not prepack_available():
        reasons.append("this torch build lacks oneDNN prepacked linear kernels")
    if param is None or param.device.type != "cpu" or any(w.device.type != "cpu" for _, w in linears):
        reasons.append("the model is not on the CPU")
    else:  # every linear layer's dtype, not the first parameter's (a VLM may keep parts in another)
        dtypes = sorted({str(w.dtype) for _, w in linears} or {str(param.dtype)})
        if len(dtypes) > 1:
            name, w = next((n, w) for n, w in linears if w.dtype != torch.float32)
            reasons.append(f"its linear layers mix dtypes {', '.join(dtypes)} (e.g. {name} is {w.dtype}), "
                           "prepacking is float32 only")
        elif dtypes != ["torch.float32"]:
            reasons.append(f"the model is {dtypes[0]}, prepacking is float32 only")
    made = next((name for name, w in linears if w.is_inference()), None)
    if made is not None:
        reasons.append(f"its weights (e.g. {made}.weight) were made under torch.inference_mode() and carry no "
                       "version counter to follow in-place edits by; create or load the model outside inference_mode")
    # accelerate stores its hook as a plain attribute: a dict lookup per module (hasattr on a
    # module that lacks it goes through nn.Module.__getattr__ and an exception, ~80 us a call here)
    if hasattr(model, "_orig_mod") or any("_hf_hook" in m.__dict__ for m in model.modules()):
        reasons.append("the model is compiled or dispatched by accelerate hooks")
    if prepack is True:
        if reasons:
            raise ValueError(f"prepack=True but {'; '.join(reasons)}; pass prepack=False or 'auto'")
        return True
    if reasons or _linear_bytes(model) > AUTO_BUDGET_BYTES:
        return False
    from mmspec.models.kernel_choice import measure  # "auto": the faster kernel on this machine, measured

    return measure(model)["prepack"]


# Per-instance dicts a view module gets its own copy of (hook registries): hooks transformers
# installs later on one (output capturing) must not be installed twice on the other.
_HOOK_PREFIXES = ("_forward", "_backward", "_state_dict")
# Dicts whose *contents* the staleness fingerprint compares (they are mutated in place).
_TRACKED = ("_parameters", "_buffers", "_modules") + _HOOK_PREFIXES


def packable(module: torch.nn.Module) -> bool:
    """A plain `nn.Linear` (`_plain_linear`) with a float32 CPU weight that is not an inference
    tensor (one made under `torch.inference_mode()` has no version counter to follow edits by)."""
    if not _plain_linear(module):
        return False
    w = module.weight
    return w.dtype == torch.float32 and w.device.type == "cpu" and not w.is_inference()


def _plain_linear(module: torch.nn.Module) -> bool:
    """A plain `nn.Linear`: weight (and bias) parameters only, no buffers, no child modules and
    no tensor-valued extra attributes, so a `PackedLinear` computes what it does (weight_norm,
    spectral_norm or LoRA-style state was lost, and the copied hooks then failed looking for it)."""
    if type(module) is not torch.nn.Linear or module._buffers or module._modules:
        return False
    params = module._parameters
    if set(params) - {"weight", "bias"} or not isinstance(params.get("weight"), torch.nn.Parameter):
        return False
    return not any(isinstance(v, (torch.Tensor, torch.nn.Module)) for k, v in vars(module).items()
                   if not k.startswith("_"))


def repack(model: torch.nn.Module) -> None:
    """Rebuild the packed copies of `model`'s view at their next use: for weights edited
    through `p.data`, which the version-counter check cannot see."""
    for entry in _views_of(model).values():
        for m in entry.view.modules():
            if isinstance(m, PackedLinear):
                m._version = -1


def _copy_hooks(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    for name, value in vars(src).items():
        if name.startswith(_HOOK_PREFIXES) and isinstance(value, dict):
            setattr(dst, name, type(value)(value))


def _view(module: torch.nn.Module, memo: dict, reuse: dict, into: torch.nn.Module | None = None,
          policy=None) -> torch.nn.Module:
    if id(module) in memo:
        return memo[id(module)]
    if not packable(module):
        if into is None:
            new = copy.copy(module)  # shallow: shares parameter tensors, buffers and config
        else:  # rebuild the root in place: runners holding the view see the new state
            new = into
            new.__dict__.clear()
            new.__dict__.update(module.__dict__)
        new.__dict__.pop(_HOLDER, None)  # the root's views stay on the model
        new._parameters = dict(module._parameters)
        new._buffers = dict(module._buffers)
        _copy_hooks(module, new)
        new._modules = {}
        memo[id(module)] = new  # before the children: a child may refer back to a shared module
        for name, child in module._modules.items():
            new._modules[name] = None if child is None else _view(child, memo, reuse, policy=policy)
        return new
    new = PackedLinear(module, reuse=reuse.get(id(module.weight)), policy=policy)
    memo[id(module)] = new
    return new


_TRACKED_BY_KEYS: dict[tuple, tuple] = {}  # a module's attribute names -> those that are tracked dicts


def _fingerprint(model: torch.nn.Module) -> tuple[tuple, list]:
    """What a view must agree with: every module reachable from `model` (in order, as
    weak references, so a freed module whose id is reused is still told apart), the
    identity of each of its attributes, and the contents of its parameter, buffer, child
    and hook dicts (training flags, replaced modules or parameters, added or removed hooks,
    monkey-patched attributes all change it). In-place weight updates are not part of it:
    `PackedLinear` follows those through the tensor version counter. The old attribute
    values stay alive in the view (its modules share them), so their ids cannot be reused."""
    ids: list = []
    mods: list = []
    seen: set = set()
    stack = [model]
    append = ids.append
    while stack:
        m = stack.pop()
        if id(m) in seen:
            append(id(m))
            continue
        seen.add(id(m))
        mods.append(m)
        d = m.__dict__
        keys = tuple(d)
        append(keys)
        append(tuple(map(id, d.values())))
        tracked = _TRACKED_BY_KEYS.get(keys)
        if tracked is None:
            tracked = _TRACKED_BY_KEYS[keys] = tuple(
                k for k in keys if k.startswith(_TRACKED) and isinstance(d[k], dict)
            )
        for name in tracked:
            value = d[name]
            if value:
                append(tuple(value))
                append(tuple(map(id, value.values())))
        children = [c for c in m._modules.values() if c is not None]
        children.reverse()
        stack += children
    return tuple(ids), mods


class _Entry:
    __slots__ = ("view", "ids", "refs", "policy")

    def __init__(self, view, ids, mods, policy=None):
        self.view, self.ids, self.policy = view, ids, policy
        self.refs = [weakref.ref(m) for m in mods]

    def current(self, ids, mods) -> bool:
        return ids == self.ids and len(mods) == len(self.refs) and all(r() is m for r, m in zip(self.refs, mods))


# A model's views ({policy key: _Entry}) are kept on the model itself (`_HOLDER`), and view ->
# (model, policy key) weakly. One view per model and policy: a wrap's policy is its own. (A weak
# dict keyed by model leaked: the view copies the model's hooks and attributes, and one that
# refers back to the model, a hook closing over it, made the value hold its own key forever.)
_HOLDER = "_mmspec_packed_views"
_SOURCES: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


class _Views(dict):
    """A model's views: pickled and deep-copied as an empty plain dict (never its packed
    copies), and only its own model's (a shallow copy of the model shares the attribute)."""

    def __init__(self, model):
        super().__init__()
        self.owner = weakref.ref(model)

    def __reduce__(self):
        return dict, ()

    def __deepcopy__(self, memo):
        return {}


def _views_of(model: torch.nn.Module, create: bool = False) -> dict:
    views = model.__dict__.get(_HOLDER)
    if isinstance(views, _Views) and views.owner() is model:
        return views
    if not create:
        return {}
    views = _Views(model)
    object.__setattr__(model, _HOLDER, views)  # a plain attribute (not a module, parameter or buffer)
    return views


def _policy_key(policy):
    return None if policy is None else (policy.rows, policy.packed)


def packed_model(model: torch.nn.Module, policy=None) -> torch.nn.Module:
    """A view of `model` whose `nn.Linear` layers run on prepacked weights (cached per model
    and policy; the model itself is left untouched). Every call checks the cached view against
    the model (`_fingerprint`) and rebuilds it in place when the model changed (a hook added
    or removed, a module or parameter replaced, `.train()` / `.eval()`, ...); unchanged
    weights keep their packed copies. `policy` (a `kernel_choice.KernelPolicy`, or None for
    the packed kernel at every row count) sets which kernel each row count uses; views of one
    model under other policies are separate (and share the packed copies of unchanged weights)."""
    entries = _views_of(model, create=True)  # before the fingerprint, which sees the model's attributes
    ids, mods = _fingerprint(model)
    key = _policy_key(policy)
    entry = entries.get(key)
    if entry is None:
        other = next(iter(entries.values()), None)  # another policy's view: reuse its packed weights
        reuse = {} if other is None else {id(m.weight): m for m in other.view.modules() if isinstance(m, PackedLinear)}
        view = _view(model, {}, reuse, policy=policy)
        entries[key] = _Entry(view, ids, mods, policy)
        _SOURCES[view] = (weakref.ref(model), key)
        return view
    if not entry.current(ids, mods):
        view = entry.view
        reuse = {id(m.weight): m for m in view.modules() if isinstance(m, PackedLinear)}
        _view(model, {}, reuse, into=view, policy=entry.policy)
        entry.ids, entry.refs = ids, [weakref.ref(m) for m in mods]
    return entry.view


def _entry_of(run: torch.nn.Module):
    """(model, _Entry) when `run` is a live packed view, else (None, None)."""
    hit = _SOURCES.get(run)
    model = hit[0]() if hit is not None else None
    entry = _views_of(model).get(hit[1]) if model is not None else None
    if entry is None or entry.view is not run:
        return None, None
    return model, entry


def kernels_of(run: torch.nn.Module, model: torch.nn.Module) -> str:
    """How `run` (the model itself or its packed view) computes its linear layers."""
    if run is model:
        return "stock"
    source, entry = _entry_of(run)
    policy = entry.policy if entry is not None and source is model else None
    return "prepacked" if policy is None else policy.describe()


def for_rows(run: torch.nn.Module, rows: int) -> torch.nn.Module:
    """What a forward of `rows` input rows (batch x tokens) should run: `run`'s own model when
    `run` is a packed view whose kernel policy takes the stock kernel at that row count, else
    `run`. Each packed linear of the view would check the policy and call the stock kernel
    anyway; the model itself skips those checks (~3 us a layer, ~5% of a one-token step of a
    small model). The two compute the same (the view shares every parameter; `refresh` keeps
    its structure current)."""
    model, entry = _entry_of(run)
    if entry is None or entry.policy is None or entry.policy.use_packed(rows):
        return run
    return model


def mixed_source(run: torch.nn.Module) -> torch.nn.Module | None:
    """`run`'s own model when `run` is a packed view under a per-row-count `KernelPolicy`
    (some row counts take the stock kernel), else None."""
    model, entry = _entry_of(run)
    return model if entry is not None and entry.policy is not None else None


def refresh(module: torch.nn.Module) -> torch.nn.Module:
    """Bring a view returned by `packed_model` / `maybe_packed` up to date with its model
    (in place; cheap when nothing changed) and return it; any other module is returned
    as is. Runners that keep a view across calls call this once per generate call."""
    model, entry = _entry_of(module)
    return module if entry is None else packed_model(model, entry.policy)


def maybe_packed(model: torch.nn.Module, prepack="auto") -> torch.nn.Module:
    """`model`, or its packed view when `should_prepack(model, prepack)`: with True the packed
    kernel at every row count, with "auto" the measured `KernelPolicy` (the faster kernel per
    row count; the view is used only when some row count prefers the packed one)."""
    if not should_prepack(model, prepack):
        return model
    if prepack is True:
        return packed_model(model, policy=None)
    from mmspec.models.kernel_choice import measure

    policy = measure(model)["policy"]
    return packed_model(model, policy=None if policy.uniform else policy)
