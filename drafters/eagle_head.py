"""`EagleHeadDrafter`: an EAGLE-2 draft head over the target's last hidden state.

EAGLE (Li et al. 2024, arXiv 2401.15077; EAGLE-2, arXiv 2406.16858; github.com/SafeAILab/EAGLE)
drafts at the feature level: one decoder layer at the target's width reads
`fc(concat(embed(x_{t+1}), h_t))`, where `h_t` is the target's final (normed) hidden state at
position t and `x_{t+1}` the token that followed, and predicts the feature `f_{t+1}`; the
target's own LM head turns it into the next-token distribution. The target's embedding and
LM head are shared and frozen (reached through the target spec's `embed` / `head`). Drafting
feeds the head its own features: `(f_{t+1}, x̂_{t+2}) -> f_{t+2}`, ...

Layout (state-dict names follow EAGLE's draft model): `fc` (2H -> H, bias), `layers.0` = a
Llama decoder layer without input norm (`self_attn.{q,k,v,o}_proj`, `post_attention_layernorm`,
`mlp.{gate,up,down}_proj`). No final norm: the features are trained to match the target's
normed hidden states.

In mmspec's loop (batched, ragged, chains and dynamic trees):
- `features = FeatureRequest(last_hidden=True, image_features=<VLM>)`; for image targets the
  head's input embedding at image-token positions is the target's merged image feature, as
  the target's own forward sees it.
- The prompt's pairs `(h_t, x_{t+1})`, t = 0..L-1, are run at the first `propose` that drafts
  (the last needs the root, which the target samples after prefill; plain K = 0 steps before
  it keep that root and their pairs: a request decoded plainly never runs the head); later steps run the pairs of the
  accepted path + bonus token (the target's verify features) in one catch-up forward. Draft
  positions are rolled back by not advancing the ragged cache (mmspec.RaggedKV).
- Chains: K head forwards (tokens sampled from the head's processed distribution, q returned);
  trees: EAGLE-2's dynamic expansion (top_k children of the top_k best frontier nodes by
  cumulative log-probability, `num_nodes` best kept), deterministic, no q.

Limits: one decoder layer (EAGLE-1/2; EAGLE-3's multi-layer fusion is not here); the head uses
1-D RoPE positions of its own, whatever the target's position scheme.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mmspec.adaptive import DraftLengthController
from mmspec.attention_choice import step_attention
from mmspec.drafters.chain_stop import ChainStop
from mmspec.adaptive_window import WindowBandit
from mmspec.drafters.model_drafter import check_max_draft_tokens
from mmspec.drafters.plain_stretch import append_at_counts
from mmspec.drafters.tree_grow import grow_tree
from mmspec.ragged import RaggedKV
from mmspec.position_noise import DraftsWithPositionNoise
from mmspec.sampling import SamplingConfig, plain_number, process_logits, sample_from
from mmspec.tree import chain_parents
from mmspec.types import CommitInfo, Draft, FeatureRequest, TargetOutput, TreeConfig, check_tree
from mmspec.versions import version_of

from .head_config import EagleHeadConfig

CONFIG_NAME = "drafter_config.json"
WEIGHTS_NAME = "drafter.safetensors"


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # weight * x / rms(x): one kernel


def rotate_half(x):
    a, b = x.chunk(2, -1)
    return torch.cat([-b, a], -1)


class HeadAttention(nn.Module):
    """The attention parameters of a head layer (q/k/v/o projections, RoPE); `HeadLayer`
    computes with them."""

    def __init__(self, c: EagleHeadConfig):
        super().__init__()
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.dim = c.hidden_size // c.num_attention_heads
        self.q_proj = nn.Linear(c.hidden_size, self.heads * self.dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.dim, c.hidden_size, bias=False)
        self.register_buffer("inv_freq", 1.0 / c.rope_theta ** (torch.arange(0, self.dim, 2).double() / self.dim),
                             persistent=False)

    def _rope(self, positions, dtype, max_position: int | None = None):
        """cos / sin [B, 1, Q, D] of `positions` (angles in float64). On CPU from a table
        computed once (regrown when a position is past its end), so drafting steps only gather;
        elsewhere computed directly (sizing the table needs the largest position on the host).
        `max_position`: a host-side upper bound of `positions` known to the caller (a drafting
        step knows its cache length), which spares reading the positions back (a sync and two
        reductions per call); positions are then >= 0 by construction (logical positions)."""
        if positions.device.type != "cpu":
            freqs = positions.unsqueeze(-1).double() * self.inv_freq
            emb = torch.cat([freqs, freqs], -1).unsqueeze(1)
            return emb.cos().to(dtype), emb.sin().to(dtype)
        if max_position is None:
            lo, hi = torch.aminmax(positions) if positions.numel() else (torch.zeros(()), torch.zeros(()))
            if int(lo) < 0:  # a table lookup would wrap around silently
                raise ValueError(f"RoPE positions must be >= 0, got {int(lo)}")
            max_position = int(hi)
        need = max_position + 1
        table = self.__dict__.get("_rope_table")
        if table is None or table[0].shape[0] < need or table[0].dtype != dtype or table[0].device != positions.device:
            n = max(need, 256 if table is None else 2 * table[0].shape[0])
            freqs = torch.arange(n, dtype=torch.float64, device=positions.device).unsqueeze(-1) * self.inv_freq
            emb = torch.cat([freqs, freqs], -1)
            table = (emb.cos().to(dtype), emb.sin().to(dtype))
            self.__dict__["_rope_table"] = table
        return table[0][positions].unsqueeze(1), table[1][positions].unsqueeze(1)


class HeadLayer(nn.Module):
    """A Llama decoder layer without input norm (EAGLE's first draft layer)."""

    def __init__(self, c: EagleHeadConfig):
        super().__init__()
        self.self_attn = HeadAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = nn.ModuleDict({
            "gate_proj": nn.Linear(c.hidden_size, c.intermediate_size, bias=False),
            "up_proj": nn.Linear(c.hidden_size, c.intermediate_size, bias=False),
            "down_proj": nn.Linear(c.intermediate_size, c.hidden_size, bias=False),
        })

    def forward(self, x, positions, visible, kv, max_position: int | None = None):
        """x [B, Q, H], positions [B, Q], visible [B, Q, S] bool (S = Q without a cache) or None
        when every query sees every key; `max_position`: see `HeadAttention._rope`. Plain tensor
        operations over stacked weights, RoPE on q and k at once: at one or a few tokens a step's
        cost is its operation count (a 128-wide layer at one token, 2-core EPYC VM: ~340 us
        through the submodules, ~210 us here)."""
        attn = self.self_attn
        w = self._weights()
        B, Q, _ = x.shape
        h, g, d = attn.heads, attn.kv_heads, attn.dim
        cos, sin = attn._rope(positions, x.dtype, max_position)  # [B, 1, Q, D] each
        qkv = F.linear(x, w["qkv"])
        qk = qkv[..., : (h + g) * d].reshape(B, Q, h + g, d).transpose(1, 2)
        qk = qk * cos + rotate_half(qk) * sin
        q, k = qk[:, :h], qk[:, h:]
        v = qkv[..., (h + g) * d:].reshape(B, Q, g, d).transpose(1, 2)
        if kv is not None:
            k, v = kv.update(0, k, v)
        if h != g:
            k, v = k.repeat_interleave(h // g, 1), v.repeat_interleave(h // g, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if visible is None else visible.unsqueeze(1))
        x = x + F.linear(out.transpose(1, 2).reshape(B, Q, h * d), w["o"])
        norm = self.post_attention_layernorm
        gate, up = F.linear(F.rms_norm(x, norm.weight.shape, w["norm"], norm.eps), w["gate_up"]).chunk(2, -1)
        return x + F.linear(F.silu(gate) * up, w["down"])

    def _weights(self) -> dict[str, torch.Tensor]:
        """The layer's weights, q/k/v and gate/up stacked. With autograd on (training) stacked
        from the live parameters at every call, so gradients reach them; with it off (drafting)
        detached and kept until a parameter changes (another tensor, dtype or device, or an
        in-place update such as an optimiser step, seen through the tensor's version counter)."""
        # The registries themselves (what attribute access reads, minus nn.Module.__getattr__'s
        # cost): always the current submodules and parameters.
        sub = self._modules
        a, m = sub["self_attn"]._modules, sub["mlp"]._modules
        params = tuple(mod._parameters["weight"] for mod in (
            a["q_proj"], a["k_proj"], a["v_proj"], a["o_proj"], m["gate_proj"], m["up_proj"], m["down_proj"],
            sub["post_attention_layernorm"]))

        def stack(q, k, v, o, gate, up, down, norm):
            return {"qkv": torch.cat([q, k, v]), "o": o, "gate_up": torch.cat([gate, up]), "down": down, "norm": norm}

        if torch.is_grad_enabled():
            return stack(*params)
        key = tuple((p.data_ptr(), version_of(p), p.dtype) for p in params)
        cache = self.__dict__.get("_stacked_cache")
        if cache is None or cache[0] != key or any(k[1] is None for k in key):  # inference tensors: no version
            cache = self.__dict__["_stacked_cache"] = (key, stack(*(p.detach() for p in params)))
        return cache[1]


class EagleHead(nn.Module):
    """The trainable part of an EAGLE drafter (the embedding and LM head are the target's)."""
    attention = "auto"  # "auto": mmspec/attention_choice.py on CUDA; "torch": torch's backend choice
    kind = "eagle"  # the EagleHeadConfig.kind this class is built from (saved with it)

    def __init__(self, config: EagleHeadConfig):
        if config.kind != self.kind:  # it would be saved as another kind and fail to load back
            raise ValueError(f"{type(self).__name__} needs EagleHeadConfig(kind={self.kind!r}), got kind={config.kind!r}; "
                             f"build it with EagleHeadConfig.for_target(model, kind={self.kind!r}, ...)")
        super().__init__()
        self.config = config
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=config.fc_bias)
        self.layers = nn.ModuleList([HeadLayer(config)])

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[B, Q, H] token embeddings + [B, Q, H] features -> the decoder layer's input."""
        return self.fc(torch.cat([embeds, hidden.to(embeds.dtype)], -1))

    def decode(self, x, positions, visible, kv: RaggedKV | None = None, max_position: int | None = None) -> torch.Tensor:
        with step_attention(x, self.config, self.attention):  # CUDA: attention backends measured on fresh shapes
            for layer in self.layers:
                x = layer(x, positions, visible, kv, max_position)
        return x

    def prepare(self, next_tokens, embeds, hidden, mask):
        """Inputs of the prompt's pairs (h_t, x_{t+1}) for a cache-free or prefill forward:
        returns (inputs [B, L', H], positions [B, L'], mask [B, L'], source index [B, L'] of each
        input's pair, global image vector [B, H] or None). EAGLE: one input per pair."""
        positions = (mask.long().cumsum(1) - 1).clamp_min(0)
        src = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
        return self.fuse(embeds, hidden), positions, mask, src, None

    def forward_full(self, next_tokens, embeds, hidden, mask):
        """Cache-free causal forward over all pairs (training and reference): features [B, L', H]
        with (positions, mask, source index) of each output."""
        x, positions, mask, src, _ = self.prepare(next_tokens, embeds, hidden, mask)
        L = x.shape[1]
        causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
        visible = (causal & mask.bool().unsqueeze(1)) | torch.eye(L, dtype=torch.bool, device=x.device)
        return self.decode(x, positions, visible), positions, mask, src

    # ---- checkpoints (our own layout: config json + safetensors) ------------------------------
    def save_pretrained(self, directory) -> None:
        from safetensors.torch import save_file

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / CONFIG_NAME).write_text(json.dumps(asdict(self.config), indent=2))
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(d / WEIGHTS_NAME))

    @classmethod
    def from_pretrained(cls, directory, dtype: torch.dtype | None = None) -> "EagleHead":
        from safetensors.torch import load_file

        d = Path(directory)
        if not (d / CONFIG_NAME).is_file():
            raise ValueError(f"{d} holds no drafter head ({CONFIG_NAME} missing)")
        raw = json.loads((d / CONFIG_NAME).read_text())
        known = {f.name for f in fields(EagleHeadConfig)}
        config = EagleHeadConfig(**{k: v for k, v in raw.items() if k in known})
        if not issubclass(head_class(config.kind), cls):
            raise ValueError(f"{d} holds a {config.kind!r} head, not a {cls.__name__}; load it with "
                             "EagleHead.from_pretrained (it builds the class the folder names)")
        head = head_class(config.kind)(config)
        try:
            head.load_state_dict(load_file(str(d / WEIGHTS_NAME)), strict=True)
        except RuntimeError as e:  # missing / unexpected / mis-shaped tensors: the file, by name
            raise ValueError(f"{d / WEIGHTS_NAME} does not fit its {CONFIG_NAME}: {e}") from None
        return head.to(dtype) if dtype is not None else head


def head_class(kind: str) -> type:
    if kind == "vispec":
        from .vispec import ViSpecHead

        return ViSpecHead
    if kind == "flash":
        from .flash import FlashHead

        return FlashHead
    return EagleHead


def target_spec(target):
    """The forward spec of a target (an mmspec target with a spec, or a transformers model)."""
    spec = getattr(target, "spec", None)
    if spec is not None:
        return spec
    if hasattr(target, "config") and callable(target):
        from mmspec.models.hf_target import HFTarget

        return HFTarget(target).spec
    raise TypeError(f"the target must be a transformers model or a SpecTarget, got {type(target).__name__}")


class EagleHeadDrafter(DraftsWithPositionNoise):
    """Drafts with an `EagleHead` over `target`'s features (any target with `supports_features`
    whose spec exposes `embed` / `head`). Build it once per target and reuse it."""

    def __init__(self, target, head: EagleHead, num_draft_tokens: int | str | None = None, tree: TreeConfig | None = None,
                 max_draft_tokens: int | None = None):
        """`num_draft_tokens`: a chain's length (default 4) or "auto"; with `tree` leave it out."""
        num_draft_tokens = plain_number(num_draft_tokens)
        if tree is not None and num_draft_tokens not in (None, "auto"):  # ("auto" is refused by name below)
            raise ValueError(f"num_draft_tokens={num_draft_tokens!r} has no effect with tree= (a tree drafts "
                             "tree.num_nodes nodes; TreeConfig(num_nodes='auto') sizes it per request): leave it out")
        num_draft_tokens = 4 if num_draft_tokens is None else num_draft_tokens
        max_draft_tokens = check_max_draft_tokens(num_draft_tokens, max_draft_tokens, default=6, tree=tree)
        # "auto" (chains): the loop picks K in 0..max_draft_tokens before every step from measured
        # costs and acceptance (mmspec/adaptive.py); K = 0 defers the head's catch-up. A tree with
        # num_nodes="auto": the node count per request (mmspec/adaptive_window.py), 0 deferring too.
        self.adaptive = (num_draft_tokens == "auto" and tree is None) or bool(getattr(tree, "adaptive", False))
        if num_draft_tokens == "auto":
            if tree is not None:
                raise ValueError("num_draft_tokens='auto' is for chains; a tree drafts tree.num_nodes nodes")
            num_draft_tokens = max_draft_tokens
        if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be an int >= 1 or 'auto', got {num_draft_tokens!r}")
        check_tree(tree, "EagleHeadDrafter", adaptive_ok=True)
        if not isinstance(head, EagleHead):
            raise TypeError(f"head must be an EagleHead, got {type(head).__name__}")
        spec = target_spec(target)
        self.spec, self.head, self.tree = spec, head, tree
        self.num_draft_tokens = num_draft_tokens
        self.vocab_size = spec.vocab_size
        if tree is not None and tree.top_k > self.vocab_size:
            raise ValueError(f"TreeConfig.top_k={tree.top_k} exceeds the target's vocabulary of {self.vocab_size} "
                             f"tokens; use top_k <= {self.vocab_size}")
        check_head_fits(head.config, target, spec)
        self.image_token_id = head.config.image_token_id
        self.features = FeatureRequest(last_hidden=True, image_features=self.image_token_id is not None)
        self.max_draft_nodes = tree.num_nodes if tree is not None else num_draft_tokens
        self.k = self.max_draft_nodes  # this step's draft length / tree size (set by the loop when adaptive)
        self.controller = (None if not self.adaptive else DraftLengthController(num_draft_tokens) if tree is None
                           else WindowBandit(tree.num_nodes))
        self._stop = ChainStop()
        self._deferred = False  # this step drafts nothing (K = 0): the head's catch-up waits
        self._after_plain = False  # the next drafting step catches up on the pairs of plain steps
        self._plain_pairs: list = []  # (next token, feature) of plain steps, appended at the next catch-up
        self._first_root = None
        self.draft_calls = 0

    def set_stop_tokens(self, token_ids) -> None:
        """The loop's EOS ids: a chain ends once every row has drafted one (drafters/chain_stop.py)."""
        self._stop.set(token_ids)

    def set_draft_length(self, k: int) -> None:
        """The loop's choice of K for the next step (adaptive drafters only)."""
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= self.max_draft_nodes:
            raise ValueError(f"draft length must be an int in 0..{self.max_draft_nodes}, got {k!r}")
        self.k = k

    @property
    def cappable(self) -> bool:
        """Chains only: the loop may shorten a step's chain (`cap_draft_length`)."""
        return self.tree is None

    def cap_draft_length(self, cap: int) -> None:
        """At most `cap` drafts this step (what the longest row can still emit; a fixed K comes
        back at the next request). Called after `set_draft_length`."""
        if not self.cappable:
            raise ValueError("cap_draft_length needs a chain drafter (no tree)")
        self.k = min(self.k, max(int(cap), 0))

    # ---- the target's shared pieces -------------------------------------------------------------
    def embed(self, tokens):
        return self.spec.embed(tokens).to(self._dtype)

    def logits(self, features):
        return self.spec.head(features.to(self.spec.dtype))

    @property
    def _dtype(self):
        return self.head.fc.weight.dtype

    def prompt_embeds(self, input_ids, image_features) -> torch.Tensor:
        """Embeddings of the prompt as the target saw them: image features at image tokens."""
        e = self.embed(input_ids)
        if self.image_token_id is None or image_features is None:
            return e
        where = input_ids == self.image_token_id
        feats = image_features.reshape(-1, e.shape[-1]).to(e.dtype)
        if int(where.sum()) != feats.shape[0]:  # SYNC: once per request
            raise ValueError(f"{int(where.sum())} image tokens in the prompt but {feats.shape[0]} image features")
        return e.masked_scatter(where.unsqueeze(-1), feats)

    # ---- protocol ---------------------------------------------------------------------------------
    def prefill(self, input_ids, attention_mask, target_out: TargetOutput, model_inputs: dict[str, Any], max_new_tokens):
        if target_out.hidden_states is None:
            raise ValueError("the target returned no last hidden state; EAGLE heads need FeatureRequest(last_hidden)")
        self._prompt = (input_ids, attention_mask, target_out.hidden_states,
                        self.prompt_embeds(input_ids, target_out.image_features))
        cfg = self.tree
        region = (2 * cfg.depth + cfg.depth * cfg.top_k) if cfg else 3 * self.num_draft_tokens
        self._max_slots = input_ids.shape[1] + max_new_tokens + region + 4
        self.kv = None
        if not self.adaptive:  # a fixed chain's K, shortened by the loop in a request's last steps
            self.k = self.max_draft_nodes
        self._shift_max = None  # host bound of pos_shift, set by _prefill_head
        self._deferred = False
        self._after_plain = False
        self._plain_pairs = []
        self._first_root = None  # the root of a request's first step while plain steps defer the prompt
        self.draft_calls = 0
        if isinstance(self.controller, WindowBandit):  # per-request choice (trees): a request begins
            self.controller.begin_request()

    def propose(self, roots: torch.Tensor, sampling: SamplingConfig, generator) -> Draft:
        B, device = roots.shape[0], roots.device
        self._deferred = self.k == 0  # (a fixed tree's k is its num_nodes)
        if self._deferred:
            # Plain decoding this step: the head runs nothing. The step's pairs wait and the next
            # drafting step catches up on all of them; the prompt too waits for that step (its
            # last pair needs the first root, kept), so a request decoded plainly throughout never
            # runs the head at all.
            if self.kv is None and self._first_root is None:
                self._first_root = roots
            self._after_plain = True
            return Draft(tokens=roots.new_zeros(B, 0), parents=roots.new_zeros(B, 0), is_chain=True)
        if self.controller is not None and (self.kv is None or self._after_plain):
            self.controller.skip_draft_cost_once()  # prompt prefill / catch-up: one-off, not the per-step cost
        self._after_plain = False
        if self.kv is None and self._first_root is not None:  # plain steps came first: the prompt, then them
            self._prefill_head(self._first_root)
            self._first_root, self.pending_host = None, [0] * B
            self.pending_tokens, self.pending_count = roots.new_zeros(B, 0), roots.new_zeros(B)
            self.pending_hidden = torch.zeros(B, 0, self.head.config.hidden_size, dtype=self.spec.dtype, device=device)
        feats = self._prefill_head(roots) if self.kv is None else self._catch_up(roots)  # [B, H] at the root
        logits = self.logits(feats)
        if self.tree is not None:
            return self._propose_tree(feats, logits, sampling)
        return self._propose_chain(feats, logits, sampling, generator)

    def _propose_chain(self, feats, logits, sampling: SamplingConfig, generator) -> Draft:
        """A chain of `self.k` tokens, one head forward per token after the first."""
        B, device = feats.shape[0], feats.device
        K = self.k
        tokens, probs = [], []
        ended = self._stop.begin(B, device)
        steps = torch.arange(K, device=device)
        noise = self._chain_noise(K, sampling, logits)
        for i in range(K):
            if sampling.greedy:  # no q is returned for greedy drafts: the argmax is enough
                d = logits.argmax(-1)
            else:
                q = process_logits(logits, sampling)
                if noise is not None:  # acceptance="invariant": Gumbel-max with the verifier's noise
                    d = (q / noise[:, i]).argmax(-1)
                else:
                    d = sample_from(q, generator)
                probs.append(q)
            tokens.append(d)
            if i == K - 1 or self._stop.every_row_ended(ended, d):
                break
            # The next chain token: it sees the whole region, so no tree visibility is needed.
            depth = steps[i : i + 1].view(1, 1).expand(B, 1)
            feats = self._forward(d.unsqueeze(1), feats.unsqueeze(1), depth, None, i, chain=True)[:, -1]
            logits = self.logits(feats)
        K = len(tokens)
        draft_probs = None if sampling.greedy else torch.stack(probs, 1)
        return Draft(tokens=torch.stack(tokens, 1), parents=chain_parents(B, K, device), draft_probs=draft_probs)

    def commit(self, info: CommitInfo, target_out: TargetOutput) -> None:
        """The next catch-up runs the pairs (target feature, token) of the accepted path and the
        new root: (h_root, a_1), ..., (h_{a_n}, next)."""
        if self._deferred:
            # K = 0: the pending pairs were not run; (h_root, next) joins each row's list at the
            # next catch-up (`_flush`, drafters/plain_stretch.py: the stretch at once, no per-step
            # copy of the growing lists, so a plain step costs what plain decoding does). The feature
            # is copied: a static-shape target may reuse its output buffer at the next forward.
            self._plain_pairs.append((info.next_tokens, target_out.hidden_states[:, 0].clone()))
            return
        n, n_host = info.num_accepted, info.num_accepted_list
        B = n.shape[0]
        rows = torch.arange(B, device=n.device)
        width = (max(n_host) if n_host else 0) + 1
        toks = torch.cat([info.accepted_tokens[:, : width - 1].clamp_min(0), n.new_zeros(B, 1)], 1)
        toks[rows, n] = info.next_tokens
        self.pending_tokens = toks
        self.pending_hidden = target_out.hidden_states.gather(
            1, info.path[:, :width].unsqueeze(-1).expand(-1, -1, target_out.hidden_states.shape[-1]))
        self.pending_count = n + 1
        self.pending_host = [a + 1 for a in n_host]

    def select_rows(self, rows: torch.Tensor, rows_host: list[int]) -> None:
        if self.kv is None:  # the prompt is not run yet (rows ended at prefill or in plain steps)
            ids, mask, hidden, embeds = self._prompt
            self._prompt = (ids[rows], mask[rows], hidden[rows], embeds[rows])
            if self._first_root is not None:
                self._first_root = self._first_root.index_select(0, rows)
            self._plain_pairs = [(t.index_select(0, rows), h.index_select(0, rows)) for t, h in self._plain_pairs]
            return
        self._flush()
        self.kv.select_rows(rows, rows_host)
        self.pos_shift = self.pos_shift.index_select(0, rows)
        self._select_state(rows)
        self.pending_tokens = self.pending_tokens.index_select(0, rows)
        self.pending_hidden = self.pending_hidden.index_select(0, rows)
        self.pending_count = self.pending_count.index_select(0, rows)
        self.pending_host = [self.pending_host[r] for r in rows_host]

    # ---- internals ------------------------------------------------------------------------------
    def _select_state(self, rows):
        """Per-row state of subclasses (ViSpec's global image vector)."""

    def _fuse(self, embeds, hidden):
        return self.head.fuse(embeds, hidden)

    def _prefill_head(self, roots):
        """Run the prompt's pairs (h_t, x_{t+1}), t = 0..L-1 (x_L = root) into a fresh cache."""
        ids, mask, hidden, embeds = self._prompt
        next_tokens = torch.cat([ids[:, 1:], roots.unsqueeze(1)], 1)
        next_embeds = torch.cat([embeds[:, 1:], self.embed(roots.unsqueeze(1))], 1)
        x, positions, mask2, _, state = self.head.prepare(next_tokens, next_embeds, hidden.to(self._dtype), mask)
        self._set_state(state)
        self.kv = RaggedKV(1, mask2, self._max_slots + x.shape[1])
        attention = self.kv.plan_prefill(mask2)
        out = self.head.decode(x, positions, attention.dense(), self.kv)
        self.kv.scrub_padding()  # SYNC: once per request; marks an unpadded batch (mask-free chain steps)
        self.draft_calls += 1
        self.pos_shift = positions[:, -1] - attention.q_pos[:, -1]  # kept positions vs cache slots
        lo, hi = (int(v) for v in torch.aminmax(self.pos_shift))  # SYNC: once per request
        # Later steps' RoPE positions are q_pos + pos_shift with q_pos <= kv_len - 1: a host bound.
        self._shift_max = hi if lo >= 0 else None
        return out[:, -1]

    def _set_state(self, state):
        pass

    def _forward(self, tokens, hidden, depth, vis, uncommitted, chain=False):
        """`chain`: the tokens extend the whole uncommitted region as a chain (a chain step, a
        catch-up), so a step of equal-length unpadded rows runs without a mask; `vis` may then
        be None (the chain is all the plan needs)."""
        return self._decode_new(self._fuse(self.embed(tokens), hidden.to(self._dtype)), depth, vis, uncommitted, chain)

    def _decode_new(self, x, depth, vis, uncommitted, chain=False):
        """The head over new inputs `x` [B, Q, H] placed after the committed prefix (see `_forward`)."""
        attention = self.kv.plan(depth, vis, uncommitted, sees_region=chain)
        self.draft_calls += 1
        visible = None if attention.full else attention.dense()
        bound = None if self._shift_max is None else self.kv.kv_len - 1 + self._shift_max
        return self.head.decode(x, attention.q_pos + self.pos_shift.unsqueeze(1), visible, self.kv, bound)

    def _flush(self) -> None:
        """Append the plain steps' pairs to each row's pending list, after its own pending pairs
        (the lists may be wider than a row needs: rows that ended were dropped with the longest
        pending path, and their width stays)."""
        if not self._plain_pairs:
            return
        m = len(self._plain_pairs)
        new_toks = torch.stack([t for t, _ in self._plain_pairs], 1)  # [B, m]
        new_hid = torch.stack([h for _, h in self._plain_pairs], 1).to(self.pending_hidden.dtype)  # [B, m, H]
        self._plain_pairs = []
        width = (max(self.pending_host) if self.pending_host else 0) + m
        self.pending_tokens = append_at_counts(self.pending_tokens, new_toks, self.pending_count, width)
        self.pending_hidden = append_at_counts(self.pending_hidden, new_hid, self.pending_count, width)
        self.pending_count = self.pending_count + m
        self.pending_host = [c + m for c in self.pending_host]

    def _catch_up(self, roots):
        self._flush()
        B, P = self.pending_tokens.shape
        rows = torch.arange(B, device=roots.device)
        tokens = self.pending_tokens.clone()
        tokens[rows, self.pending_count - 1] = roots
        depth = torch.arange(P, device=roots.device).expand(B, P)  # a chain: no tree visibility needed
        out = self._forward(tokens, self.pending_hidden, depth, None, 0, chain=True)
        self.kv.advance(self.pending_count, self.pending_host)
        return out[rows, self.pending_count - 1]

    def _propose_tree(self, root_feats, root_logits, sampling: SamplingConfig) -> Draft:
        B = root_feats.shape[0]
        k = self.tree.top_k
        rows = torch.arange(B, device=root_feats.device).unsqueeze(1)
        state = {"feats": root_feats.unsqueeze(1).expand(B, k, -1)}  # feature each frontier token was predicted from

        def expand(frontier_tokens, parent_slot, level, vis, region):
            parent_feats = state["feats"] if parent_slot is None else state["out"][rows, parent_slot]
            depth = torch.full((B, k), level - 1, dtype=torch.long, device=root_feats.device)
            out = self._forward(frontier_tokens, parent_feats, depth, vis, region)
            state["out"] = out
            return self.logits(out)

        return grow_tree(root_logits, self.tree, expand, num_nodes=self.k,
                         **self._tree_noise(self.tree.depth, sampling, torch.float64))


def check_head_fits(config: EagleHeadConfig, target, spec) -> None:
    """Refuse a head trained for another target (width, vocabulary, image token)."""
    source = getattr(target, "model", target)
    text = None
    if hasattr(source, "config"):
        text = source.config.get_text_config() if hasattr(source.config, "get_text_config") else source.config
    hidden = getattr(text, "hidden_size", None) if text is not None else None
    if hidden is not None and int(hidden) != config.hidden_size:
        raise ValueError(f"drafter head has hidden size {config.hidden_size} but the target's is {hidden}; "
                         "it was trained for another target")
    if config.vocab_size != spec.vocab_size:
        raise ValueError(f"drafter head has vocabulary {config.vocab_size} but the target's is {spec.vocab_size}; "
                         "it was trained for another target")
    if hasattr(source, "config"):
        image_token = getattr(source.config, "image_token_id", getattr(source.config, "image_token_index", None))
        if image_token is not None and config.image_token_id is not None and int(image_token) != config.image_token_id:
            raise ValueError(f"drafter head expects image token {config.image_token_id} but the target uses "
                             f"{image_token}; it was trained for another target")
        if image_token is None and config.image_token_id is not None:
            raise ValueError(f"drafter head expects image token {config.image_token_id} but the target "
                             f"{type(source).__name__} takes no images")
