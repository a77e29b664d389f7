"""`HFSpec`: the forward spec of any transformers causal LM or VLM with an LM head.

The spec runs the model's *own* forward (so that every family's embedding scale, logit
soft-capping, image merging and mask rules apply exactly) over a `RaggedCache`, and exposes
the pieces other components share: `embed` (the input embeddings), `head` (the output
embeddings), `positions` (1-D logical positions; Qwen2-VL's spec derives M-RoPE from them).

- Prefill of an unpadded batch (or of a prefix-LM model with `token_type_ids`) passes the
  prompt's 2-D attention mask: transformers builds its own causal mask (fused causal kernels
  where the model allows; sliding windows; prefix-LM masks), exactly as its `generate` does.
  A left-padded batch gets our own 4-D mask (pad queries see themselves, so no NaN appears).
- Verify passes a 4-D additive float mask (tree attention over the ragged cache), built per
  attention type: a sliding-window layer sees only the last `sliding_window` positions.
- Drafter features (`FeatureRequest`) are captured with temporary forward hooks: the base
  model's output (final hidden state, image features) and chosen decoder layers. Nothing else
  is kept (no `output_hidden_states=True`).
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

import torch

from mmspec.models.hf_attention import attention_configs, hf_selected
from mmspec.models.hf_cache import RaggedCache, cache_argument
from mmspec.models.hf_direct import DirectDecoder, check_layer_range, direct_supported
from mmspec.models.prepack import for_rows, mixed_source
from mmspec.ragged import Attention, RaggedKV
from mmspec.spec import ForwardSpec, SpecOutput
from mmspec.types import FeatureRequest


def text_config(model):
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def text_vocab_size(model) -> int:
    return int(text_config(model).vocab_size)


def _pooled_image_features(output):
    """The projected image features of a VLM base model's output. transformers 5.24 moved them to
    `output.image_outputs.pooler_output` and keeps `image_hidden_states` as a deprecated alias that
    "will return a list of all hidden states per layer from v5.30": read the new field where the
    output class has it (never the alias, which would then silently be something else)."""
    if "image_outputs" in getattr(type(output), "__dataclass_fields__", {}):
        inner = output.image_outputs
        return None if inner is None else getattr(inner, "pooler_output", None)
    return getattr(output, "image_hidden_states", None)


def _decoder_layers(model, num_layers: int) -> torch.nn.ModuleList | None:
    """The decoder-layer list of the (language) model: the first ModuleList of the right length
    under `get_decoder()` (which is the language model for VLMs)."""
    root = model.get_decoder() if hasattr(model, "get_decoder") else model
    for module in root.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers:
            return module
    return None


_PLACEHOLDER_NAMES = {"image": ("image_token_id", "image_token_index"), "video": ("video_token_id", "video_token_index")}


def placeholder_ids(config, kinds=("image", "video")) -> list[int]:
    """The multimodal placeholder token ids a VLM config declares (transformers spells them
    `*_token_id` or, in older configs, `*_token_index`)."""
    return [v for kind in kinds for name in _PLACEHOLDER_NAMES[kind]
            if isinstance(v := getattr(config, name, None), int) and not isinstance(v, bool)]


_POSITION_TABLES = ("wpe", "embed_positions", "position_embeddings")  # GPT-2 / GPT-Neo; OPT / BioGPT; BERT-style


def learned_position_limit(model) -> int | None:
    """How many positions the model's absolute position table can index (GPT-2's `wpe`:
    `n_positions`; OPT's `embed_positions` less its offset of 2; CTRL's sinusoidal `pos_encoding`
    tensor), or None for models without one (RoPE and the like extrapolate). Past it the table
    lookup fails deep in the forward (an IndexError on the CPU, a device-side assert that ends
    the CUDA context)."""
    try:
        root = model.get_decoder()  # the language model of a VLM: never its vision tower's table
    except Exception:  # noqa: BLE001 - models without (or with a failing) get_decoder
        root = None
    root = root if isinstance(root, torch.nn.Module) else model
    limits = [m.num_embeddings - int(getattr(m, "offset", 0) or 0) for name, m in root.named_modules()
              if isinstance(m, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in _POSITION_TABLES]
    # CTRL: a fixed-size sinusoidal table held as a tensor, indexed by position all the same
    limits += [t.shape[0] for name, t in root.named_buffers()
               if name.rsplit(".", 1)[-1] == "pos_encoding" and t.dim() >= 1]
    return min(limits) if limits else None


class HFSpec(ForwardSpec):
    """Forward spec of a `transformers.PreTrainedModel` with an LM head (`model` may be
    mmspec's prepacked view of it; `source` is the user's model, for introspection)."""

    def __init__(self, model, source=None):
        self.model = model
        source = source if source is not None else model
        config = text_config(source)
        self.num_layers = int(config.num_hidden_layers)
        self.vocab_size = int(config.vocab_size)
        self.max_positions = learned_position_limit(source)
        self._source = source
        self.dtype = _model_dtype(source)
        self.forward_params = set(inspect.signature(source.forward).parameters)
        self._windows = _window_plan(config, source)
        self._prefill_inputs: dict[str, Any] = {}
        self._cache: RaggedCache | None = None
        self._io = None  # (model, input embedding, output embedding), see `_io_modules`
        # Step forwards of whitelisted decoder-only families skip the model-level wrappers
        # (mmspec/models/hf_direct.py); None: always the model's own forward.
        self._direct = DirectDecoder(source) if direct_supported(source) else None
        self._attn_configs = None  # (module tree, its attention configs), see `_attention_configs`

    # ---- pieces shared with drafters -----------------------------------------------------------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._io_modules()[1](tokens)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        io = self._io_modules()
        if io[3] is not None and for_rows(self.model, hidden.numel() // hidden.shape[-1]) is not self.model:
            return io[3](hidden)  # the stock kernel at this row count: the model's own head
        return io[2](hidden)

    def _io_modules(self):
        """(model, input embedding, output embedding, the unpacked model's output embedding or
        None) as callables, looked up once per request (a drafter calls `embed` / `head` several
        times per step; the lookup walks VLM wrappers). A plain `nn.Embedding` / `nn.Linear`
        without hooks is called as the function its forward is (the same kernel on the same
        parameter, read at call time), sparing the module-call machinery; anything else (a
        subclass, hooks, a packed view) as the module."""
        io = self._io
        if io is None or io[0] is not self.model:
            stock = mixed_source(self.model)  # a packed view whose policy takes stock kernels at some row counts
            io = self._io = (self.model, _plain_call(self.model.get_input_embeddings()),
                             _plain_call(self.model.get_output_embeddings()),
                             None if stock is None else _plain_call(stock.get_output_embeddings()))
        return io

    # ---- per request ---------------------------------------------------------------------------
    def begin(self, input_ids, attention_mask, model_inputs: dict[str, Any]) -> None:
        from mmspec.models.prepack import refresh

        # A target/drafter built once and reused: bring a prepacked view up to date with its
        # model (hooks added, head replaced, train/eval switched since the last call).
        self.model = refresh(self.model)
        self._io = None  # embeddings may have been replaced since the last request
        self.dtype = _model_dtype(self._source)  # masks follow a model cast since the wrap (`model.to(dtype)`)
        reserved = sorted(set(model_inputs) & _RESERVED)
        if reserved:
            raise ValueError(f"model inputs {reserved} are managed by mmspec's loop; do not pass them")
        if "labels" in model_inputs:  # the forward would compute a training loss (and fail on the shapes)
            raise ValueError("labels= is a training input (the model computes a loss from it); generation takes none: "
                             "drop labels")
        if "token_type_ids" in model_inputs and getattr(self._source.config, "model_type", "") not in PREFIX_LM:
            raise ValueError(
                f"{type(self._source).__name__} adds a token type embedding to every token, and generate extends "
                "token_type_ids to the generated ones; mmspec passes them to the prompt only (prefix-LM masks: "
                f"{', '.join(sorted(PREFIX_LM))}), which would change the answer: drop token_type_ids")
        unknown = sorted(k for k in model_inputs if k not in self.forward_params)
        if unknown:
            drafter_options = [k for k in unknown if k in ("num_draft_tokens", "max_draft_tokens", "tree")]
            hint = (f" ({', '.join(drafter_options)}: an option of the drafter, e.g. "
                    "ModelDrafter(model, num_draft_tokens=...))" if drafter_options else "")
            raise ValueError(
                f"{type(self.model).__name__}.forward takes no argument(s) {unknown}; remove them (misspelt generation "
                "options such as 'temprature' land here too: the speculative options are keyword arguments of "
                f"speculative_generate){hint}"
            )
        self._check_token_ids(input_ids)

    def _check_token_ids(self, input_ids) -> None:
        """Every prompt id (padding included: the model embeds it too) must index the input
        embedding; otherwise torch would fail deep inside the forward with an IndexError (CPU)
        or a device-side assert (CUDA) that names neither the id nor the vocabulary."""
        weight = getattr(self.model.get_input_embeddings(), "weight", None)
        if not isinstance(weight, torch.Tensor) or input_ids.numel() == 0:
            return
        rows = weight.shape[0]
        # Multimodal placeholders (an image / video token id) may lie past the embedding in
        # some families, whose forward swaps them out before embedding: not refused here.
        config = getattr(self.model, "config", None)
        special = [v for v in placeholder_ids(config) if v >= rows]
        if special:
            input_ids = input_ids[~torch.isin(input_ids, torch.tensor(special, device=input_ids.device))]
            if input_ids.numel() == 0:
                return
        lo, hi = (int(v) for v in torch.aminmax(input_ids))  # SYNC: once per request
        if lo < 0 or hi >= rows:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"input_ids hold token id {bad}, outside the model's vocabulary of {rows} embeddings (ids 0..{rows - 1}); "
                "tokenize with the target's own tokenizer (and pad with its pad_token_id)"
            )

    # ---- forwards -----------------------------------------------------------------------------------
    def prefill(self, input_ids, attention: Attention, kv: RaggedKV, model_inputs, features) -> SpecOutput:
        # SYNC: once per request. Without padding the model builds its own causal mask from the
        # 2-D mask (fused causal kernels; sliding windows; prefix-LM masks from token_type_ids).
        # With left padding we pass our own 4-D mask, in which a pad query sees itself: the
        # models' masks leave pad queries fully masked, which in eager float64 attention turns
        # into NaN that a masked-out key still spreads (0 * NaN). Prefix-LM masks (token_type_ids)
        # are model-specific, so those always go through the model's own mask.
        padded = not bool(attention.key_padding.all())
        if padded and "token_type_ids" not in model_inputs:
            mask = self._additive(attention)
        else:
            mask = attention.key_padding.long()
        positions = self.prefill_positions(attention)
        return self._run(input_ids, mask, positions, kv, features, keep=1, model_inputs=model_inputs)

    def forward(self, tokens, attention: Attention, kv: RaggedKV, features, *, last_only=False) -> SpecOutput:
        # Everything visible and no sliding window: the model's own (mask-free) attention path.
        mask = None if attention.full and self._windows is None else self._additive(attention)
        positions = self.positions(attention.q_pos)
        keep = int(last_only)  # transformers' logits_to_keep: 0 = every query, n = the last n
        direct = self._direct
        run = for_rows(self.model, tokens.numel())  # this forward's faster kernel (the model or its packed view)
        if mask is not None and self.cpu_attention and direct is not None and tokens.device.type == "cpu":
            configs = self._attention_configs(run)
            if configs:  # the attention form measured fastest for these shapes (mmspec/cpu_attention.py)
                with hf_selected(configs):
                    return self._step(run, direct, tokens, mask, positions, kv, features, keep)
        return self._step(run, direct, tokens, mask, positions, kv, features, keep)

    def _step(self, run, direct, tokens, mask, positions, kv, features, keep) -> SpecOutput:
        # Step forwards carry no images, so a request for image features returns None either way.
        if direct is not None and type(kv) is RaggedKV and direct.usable(run):
            logits, hidden, layers = direct.forward(
                run, tokens, mask, positions, self._cache_for(kv), keep=keep, last_hidden=features.last_hidden,
                hidden_layers=tuple(features.hidden_layers))
            return SpecOutput(logits=logits, hidden=hidden, layers=layers, image_features=None,
                              positions=positions if features.positions else None)
        return self._run(tokens, mask, positions, kv, features, keep=keep, model_inputs={})

    def _attention_configs(self, run) -> list:
        """The configs the decoder's attention modules of `run` read (cached per module tree;
        re-checked per step, since a user may switch the implementation between calls), or []
        when they do not all run "sdpa"."""
        cached = self._attn_configs
        if cached is None or cached[0] is not run:
            cached = self._attn_configs = (run, attention_configs(self._direct.base(run)))
        configs = cached[1]
        return configs if all(c._attn_implementation_internal == "sdpa" for c in configs) else []

    def prefill_positions(self, attention: Attention) -> torch.Tensor:
        """Model positions of the prompt (M-RoPE specs compute them from the image grids)."""
        return self.positions(attention.q_pos)

    def image_feature_module(self) -> torch.nn.Module | None:
        """A module whose output is the projected image features, for specs whose base model does
        not return `image_hidden_states` (None: read them from the base model's output)."""
        return None

    def _additive(self, attention: Attention):
        """4-D additive float mask(s) [B, 1, Q, S]: one tensor, or one per attention type for
        models that alternate sliding-window and full layers."""
        neg = torch.finfo(self.dtype).min

        def additive(window):
            vis = attention.dense(window)
            return torch.zeros(vis.shape, dtype=self.dtype, device=vis.device).masked_fill(~vis, neg).unsqueeze(1)

        if self._windows is None:
            return additive(None)
        if isinstance(self._windows, dict):
            return {kind: additive(w) for kind, w in self._windows.items()}
        return additive(self._windows)

    def _cache_for(self, kv: RaggedKV) -> RaggedCache:
        """transformers' view of the store (one per store, kept across forwards)."""
        if self._cache is None or self._cache.store is not kv:
            self._cache = RaggedCache(kv)
        return self._cache

    def _run(self, input_ids, mask, positions, kv, features: FeatureRequest, *, keep, model_inputs) -> SpecOutput:
        cache = self._cache_for(kv)
        captured: dict[Any, torch.Tensor] = {}
        # This forward's faster kernel; image features are read by hooks on the view's modules.
        run = self.model if features.image_features else for_rows(self.model, input_ids.numel())
        handles = self._hooks(features, captured, run) if not features.empty else []
        try:
            out = run(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{cache_argument(run): cache},
                logits_to_keep=keep,
                **model_inputs,
            )
        finally:
            for h in handles:
                h.remove()
        logits = getattr(out, "logits", None)
        if logits is None:
            raise TypeError(f"{type(self.model).__name__} returned no logits; the target needs a model with an LM head")
        return SpecOutput(
            logits=logits,
            hidden=captured.get("last"),
            layers={i: captured[i] for i in features.hidden_layers if i in captured},
            image_features=captured.get("image"),
            positions=positions if features.positions else None,
        )

    def _hooks(self, features: FeatureRequest, captured: dict, run) -> list:
        """Forward hooks on `run` (the model or its packed view: the module tree the forward runs).
        A bare model may be shared by requests on other threads: the hooks read only forwards of
        the thread that set them (a forward runs on its caller's thread), so another request's
        batch cannot land in this one's features."""
        handles = []
        owner = threading.get_ident()
        if features.last_hidden or features.image_features:

            def base_hook(module, args, output):
                if not torch.compiler.is_compiling() and threading.get_ident() != owner:  # (compiled: the caller's thread)
                    return
                hidden = getattr(output, "last_hidden_state", None)
                if hidden is None and isinstance(output, tuple):
                    hidden = output[0]
                captured["last"] = hidden
                image = _pooled_image_features(output)
                if isinstance(image, (list, tuple)):  # one tensor per image (transformers >= 5.24)
                    image = torch.cat([t.reshape(-1, t.shape[-1]) for t in image]) if image else None
                if image is not None:
                    captured["image"] = image

            handles.append(run.base_model.register_forward_hook(base_hook))
            image_module = self.image_feature_module() if features.image_features else None
            if image_module is not None:

                def image_hook(module, args, output):
                    if torch.compiler.is_compiling() or threading.get_ident() == owner:
                        captured["image"] = getattr(output, "pooler_output", output)

                handles.append(image_module.register_forward_hook(image_hook))
        if features.hidden_layers:
            check_layer_range(features.hidden_layers, self.num_layers)
            layers = _decoder_layers(run, self.num_layers)
            if layers is None:
                raise ValueError(f"cannot find the decoder layers of {type(run).__name__} to read hidden_layers")
            for i in features.hidden_layers:

                def layer_hook(module, args, output, i=i):
                    if torch.compiler.is_compiling() or threading.get_ident() == owner:
                        captured[i] = output[0] if isinstance(output, tuple) else output

                handles.append(layers[i].register_forward_hook(layer_hook))
        return handles


# Families whose token_type_ids only shape the prompt's attention mask (image tokens see each
# other): honoured at prefill. Elsewhere (GPT-2, GPT-J, ...) they are embedded at every token.
PREFIX_LM = {"gemma3", "gemma3n", "paligemma", "shieldgemma2"}

_RESERVED = {"input_ids", "attention_mask", "position_ids", "past_key_values", "cache", "use_cache", "logits_to_keep",
             "cache_position", "inputs_embeds"}


def _model_dtype(model) -> torch.dtype:
    """The dtype the decoder computes in: its input embedding's (a VLM's vision tower may be
    kept in another dtype than its language model), else the first floating parameter's."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embed, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point():
        return weight.dtype
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _window_plan(config, model):
    """How verify masks honour sliding windows: None (no window), an int (every layer slides),
    or {attention type: window or None} for models that alternate layer types and take a mask
    per type (transformers' `layer_types`)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        kinds = set(layer_types)
        # Checked before anything else: Llama-4's chunked layers (no sliding ones) went through as
        # full attention, and the verify mask dropped their chunk limit.
        unknown = kinds - {"sliding_attention", "full_attention"}
        if unknown:
            raise ValueError(
                f"{type(model).__name__} uses attention types {sorted(unknown)} that mmspec cannot mask exactly; "
                "it is not supported as a target or drafter"
            )
        if "sliding_attention" not in kinds or window is None:
            return None
        return {kind: (window if kind == "sliding_attention" else None) for kind in kinds}
    if window is None:
        return None
    # No per-layer types: the model applies `sliding_window` to every layer when its forward
    # builds a sliding-window mask (Mistral, Phi-3); otherwise the field is unused.
    source = inspect.getsource(type(model.get_decoder() if hasattr(model, "get_decoder") else model))
    return int(window) if "create_sliding_window_causal_mask" in source else None


def _plain_call(module):
    """`module`'s forward as a function of its input when it is exactly an `nn.Embedding`
    without max_norm or an `nn.Linear`, and carries no hooks; else the module itself."""
    import torch.nn.functional as F
    from torch.nn.modules import module as nn_module

    if module is None or module._forward_hooks or module._forward_pre_hooks or nn_module._global_forward_hooks \
            or nn_module._global_forward_pre_hooks:
        return module
    params = module._parameters
    if type(module) is torch.nn.Embedding and module.max_norm is None:
        return lambda tokens: F.embedding(tokens, params["weight"], module.padding_idx)
    if type(module) is torch.nn.Linear:
        return lambda x: F.linear(x, params["weight"], params["bias"])
    return module
