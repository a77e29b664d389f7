"""`ModelDrafter`: any HF causal LM sharing the target's vocabulary drafts chains or
EAGLE-2-style dynamic trees.

Chains (Leviathan et al. 2023; gpt-fast's `speculative_decode`): K autoregressive drafter
forwards; tokens are sampled from the processed drafter distribution q (temperature > 0,
`draft_probs` returned) or taken greedily (temperature 0, q one-hot).

Dynamic trees (EAGLE-2, Li et al. 2024, arXiv 2406.16858, github.com/SafeAILab/EAGLE):
expand the `top_k` children of each of the `top_k` best frontier nodes, ranking by
cumulative drafter log-probability; the next frontier is the best `top_k` of those
`top_k**2` candidates; after `depth` levels keep the `num_nodes` best nodes of the whole
pool. A child's score never exceeds its parent's, so the kept set is closed under
ancestors (a tiny depth penalty breaks ties the right way). Tree children are deterministic,
so tree drafts carry no q.

Cache bookkeeping: the drafter keeps its own `RaggedCache`. Tokens committed by the step
but not yet seen by the drafter (`pending`: the accepted tree path, or the last chain token
when every draft was accepted) are run together with the new root in one catch-up forward
at the start of `propose`. Image inputs are not passed: this drafter reads text only
(Gagrani et al. 2024 show text-only drafters are a strong VLM baseline).
"""

from __future__ import annotations

from typing import Any

import torch

from mmspec.adaptive import DraftLengthController
from mmspec.adaptive_window import WindowBandit
from mmspec.drafters.tree_grow import grow_tree
from mmspec.drafters.chain_stop import ChainStop
from mmspec.drafters.plain_stretch import append_at_counts
from mmspec.spec import ForwardSpec, SpecRunner
from mmspec.spec_target import chain_visibility
from mmspec.position_noise import DraftsWithPositionNoise
from mmspec.sampling import SamplingConfig, plain_number, process_logits, sample_from
from mmspec.tree import chain_parents
from mmspec.types import CommitInfo, Draft, TargetOutput, TreeConfig, check_tree


def drafter_spec(model, prepack) -> ForwardSpec:
    """The forward spec a drafter model runs through: its own when it is an
    `mmspec.spec.ForwardSpec` (mmspec's own models), transformers' otherwise."""
    if isinstance(model, ForwardSpec):
        return model
    if not hasattr(model, "config") or not callable(model):
        raise TypeError(
            f"model must be a transformers PreTrainedModel or an mmspec.spec.ForwardSpec, got {type(model).__name__}"
        )
    from mmspec.models.hf_target import check_supported, spec_class
    from mmspec.models.prepack import kernels_of, maybe_packed

    check_supported(model)
    run = maybe_packed(model, prepack)
    spec = spec_class(model)(run, source=model)
    spec.kernels = kernels_of(run, model)
    return spec



def check_max_draft_tokens(num_draft_tokens, max_draft_tokens, default: int, tree=None) -> int:
    """The largest K of an adaptive ("auto") chain drafter; `max_draft_tokens` is refused with a
    fixed `num_draft_tokens` or a tree, where it would have no effect."""
    if max_draft_tokens is None:
        return default
    max_draft_tokens = plain_number(max_draft_tokens)
    if tree is not None:
        raise ValueError(f"max_draft_tokens={max_draft_tokens!r} is for chains (num_draft_tokens='auto'); a tree's "
                         "largest size is its num_nodes (TreeConfig(num_nodes=N, adaptive=True), or num_nodes='auto')")
    if num_draft_tokens != "auto":
        raise ValueError(f"max_draft_tokens={max_draft_tokens!r} only applies to num_draft_tokens='auto'; "
                         f"with num_draft_tokens={num_draft_tokens!r} the draft length is fixed")
    if isinstance(max_draft_tokens, bool) or not isinstance(max_draft_tokens, int) or max_draft_tokens < 1:
        raise ValueError(f"max_draft_tokens must be an int >= 1, got {max_draft_tokens!r}")
    return max_draft_tokens

class ModelDrafter(DraftsWithPositionNoise):
    """Drafts with a small HF causal LM (or any `mmspec.spec.ForwardSpec`): a chain of
    `num_draft_tokens` tokens or, with `tree=TreeConfig(...)`, a dynamic tree (then
    `num_draft_tokens` must not be given).

    `num_draft_tokens="auto"` (the default for chains) lets the loop choose K in
    0..`max_draft_tokens` before every step from measured costs and acceptance
    (mmspec/adaptive.py); K = 0 is plain decoding (the drafter does no work that step and
    catches up later). The controller lives on the drafter, so a drafter built once keeps
    what it learned across calls. `prepack` ("auto", True, False): run its linear layers on
    oneDNN-prepacked weights when that is measured faster (mmspec/models/kernel_choice.py).

    `static=True` / `compile=...` (the opt-in GPU path, docs/architecture.md): every drafter
    forward of a request has fixed shapes per kind (the catch-up forward padded to its longest
    case, one-token chain draft steps, `top_k`-token tree levels) over a `StaticKV`, and
    `compile` wraps them in `torch.compile(..., dynamic=False)`. Needs a fixed draft length or a
    tree: with "auto", plain steps pile up pending tokens, so the catch-up has no bound.

    `attention` ("auto", "torch"): on CUDA, which attention backends the eager forwards use
    ("auto": measured on fresh shapes, mmspec/attention_choice.py; "torch": torch's choice, and on
    CPU no mmspec CPU attention either, mmspec/cpu_attention.py)."""

    def __init__(
        self,
        model,
        num_draft_tokens: int | str | None = None,
        tree: TreeConfig | None = None,
        *,
        max_draft_tokens: int | None = None,
        prepack="auto",
        static: bool | None = None,
        compile=None,
        attention: str = "auto",
    ):
        from mmspec.compiled import static_and_compile

        check_tree(tree, "ModelDrafter", adaptive_ok=True)
        if tree is not None and num_draft_tokens is not None:
            raise ValueError(
                f"num_draft_tokens={num_draft_tokens!r} has no effect with tree=: a tree drafts tree.num_nodes="
                f"{tree.num_nodes} nodes over tree.depth={tree.depth} levels; pass one of num_draft_tokens or tree"
            )
        num_draft_tokens = plain_number(num_draft_tokens)  # (np.int64(3) means 3)
        if num_draft_tokens is None:
            num_draft_tokens = "auto" if tree is None else 0  # trees draft tree.num_nodes
        max_draft_tokens = check_max_draft_tokens(num_draft_tokens, max_draft_tokens, default=8, tree=tree)
        self.adaptive = (num_draft_tokens == "auto" and tree is None) or (tree is not None and tree.adaptive)
        if self.adaptive:
            num_draft_tokens = max_draft_tokens
        elif isinstance(num_draft_tokens, str):
            raise ValueError(f"num_draft_tokens must be an int >= 0 or 'auto', got {num_draft_tokens!r}")
        if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int):
            raise TypeError(f"num_draft_tokens must be an int, got {num_draft_tokens!r} ({type(num_draft_tokens).__name__})")
        if num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be an int >= 0, got {num_draft_tokens!r}")
        self.static, compile_opts = static_and_compile(static, compile)
        if self.static and self.adaptive:
            raise ValueError(
                "static=True / compile= needs a fixed draft length or a fixed tree: with num_draft_tokens='auto' or "
                "TreeConfig(num_nodes='auto') the tokens of plain steps pile up for one catch-up forward of unbounded "
                "length; pass num_draft_tokens=K or a tree's num_nodes"
            )
        self.model = model
        self.num_draft_tokens = num_draft_tokens
        self.tree = tree
        if compile_opts is not None and not isinstance(model, ForwardSpec):
            from mmspec.models.hf_target import prepack_for_compile

            prepack = prepack_for_compile(prepack, compile)
        spec = drafter_spec(model, prepack)
        self.kernels = getattr(spec, "kernels", "")
        self.vocab_size = spec.vocab_size
        self.max_positions = getattr(spec, "max_positions", None)
        if tree is not None and tree.top_k > self.vocab_size:
            raise ValueError(
                f"TreeConfig.top_k={tree.top_k} exceeds the drafter's vocabulary of {self.vocab_size} tokens; "
                f"use top_k <= {self.vocab_size}"
            )
        self.runner = SpecRunner(spec, static=self.static, compile=compile_opts, attention=attention)
        # Static query counts per forward kind: the catch-up runs the pending tokens (at most one
        # for a chain, the accepted path of at most `depth` nodes for a tree) and the root.
        self._catch_up_queries = None
        if self.static:
            self._catch_up_queries = tree.depth + 1 if tree is not None else 2
        if not self.adaptive:
            self.controller = None
        elif tree is None:
            self.controller = DraftLengthController(num_draft_tokens)
        else:  # a tree's node count: per request, by measured speed (a tree has no per-position acceptance)
            self.controller = WindowBandit(tree.num_nodes)
        self.k = num_draft_tokens if tree is None else tree.num_nodes  # this step's draft size (the loop sets it)
        self._cap: int | None = None  # the loop's cap this step (`cap_draft_length`)
        self._drafted = 0  # tokens the last chain drafted (k, or fewer when it ended at EOS)
        self._stop = ChainStop()
        self.max_draft_nodes = tree.num_nodes if tree is not None else num_draft_tokens
        self.draft_calls = 0
        self._prefill_args: tuple[torch.Tensor, torch.Tensor, int] | None = None  # a deferred prompt prefill
        self._deferred: list[torch.Tensor] = []
        self._plain_steps = 0

    # ---- protocol --------------------------------------------------------------------------
    def prefill(self, input_ids, attention_mask, target_out: TargetOutput, model_inputs: dict[str, Any], max_new_tokens: int):
        w = self.shadow_window  # a class attribute a user may override: checked where it is read from
        if self.shadow_probes and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"ModelDrafter.shadow_window must be an int >= 1 (the plain-stretch tokens a shadow probe "
                             f"reads), got {w!r}")
        if self.tree is not None:
            region = self.tree.depth * self.tree.top_k + self.tree.depth + 2
        else:
            region = self.num_draft_tokens + 2
        slots = input_ids.shape[1] + max_new_tokens + region + 2
        B = input_ids.shape[0]
        self.pending = input_ids.new_zeros(B, 0)
        self.pending_count = input_ids.new_zeros(B)
        self.pending_host = [0] * B
        self._deferred = []  # plain steps' roots, appended at the next catch-up
        self._plain_steps = 0  # K = 0 steps since the drafter last ran
        self._cap = None
        if self.adaptive or max_new_tokens <= (2 if self.cappable else 1):
            # Deferred to the first step that drafts: a request the controller decodes plainly
            # throughout never pays for the drafter's prompt prefill, nor one that no step can
            # draft for (one new token: the prefill's; two: a capped chain's one step drafts 0).
            self._prefill_args = (input_ids, attention_mask, slots)
            self.draft_calls = 0
            if isinstance(self.controller, WindowBandit):  # per-request choice (trees): a request begins
                self.controller.begin_request()
        else:
            self._prefill_args = None
            self.runner.prefill(input_ids, attention_mask, slots, {})
            self.draft_calls = 1

    def propose(self, roots: torch.Tensor, sampling: SamplingConfig, generator) -> Draft:
        B = roots.shape[0]
        device = roots.device
        K = self.k if self._cap is None else min(self.k, self._cap)
        if K == 0 and (self.tree is None or self.adaptive):  # (a fixed tree always drafts)
            self._drafted = 0
            take_shadow = getattr(self.controller, "take_shadow", None) if self.shadow_probes else None
            if take_shadow is not None and take_shadow():
                # A shadow probe: catch up now, reading greedy acceptance off the plain stretch.
                self._catch_up(roots, shadow=True)
                self.pending, self.pending_count = roots.new_zeros(B, 0), roots.new_zeros(B)
                self.pending_host = [0] * B
            else:
                # Plain decoding this step: no drafter forward; the root joins the tokens the
                # drafter will catch up on the next time it drafts.
                self._defer(roots)
                self._plain_steps += 1
            return Draft(tokens=roots.new_zeros(B, 0), parents=roots.new_zeros(B, 0), is_chain=True)
        logits = self._catch_up(roots)  # [B, V] at the root
        if self.tree is not None:
            return self._propose_tree(logits, sampling)
        tokens, probs = [], []
        ended = None if self.static else self._stop.begin(B, device)
        noise = self._chain_noise(K, sampling, logits)
        for i in range(K):
            q = process_logits(logits, sampling)
            if noise is not None:  # acceptance="invariant": Gumbel-max with the verifier's noise
                d = (q / noise[:, i]).argmax(-1)
            else:
                d = q.argmax(-1) if sampling.greedy else sample_from(q, generator)
            tokens.append(d)
            probs.append(q)
            if i == K - 1 or self._stop.every_row_ended(ended, d):
                break
            vis = torch.ones(B, 1, i + 1, dtype=torch.bool, device=device)
            depth = torch.full((B, 1), i, dtype=torch.long, device=device)
            logits = self.runner.forward(d.unsqueeze(1), depth, vis, i, last_only=True, queries=1,
                                         sees_region=True).logits[:, -1]
            self.draft_calls += 1
        self._drafted = K = len(tokens)
        draft_probs = None if sampling.greedy else torch.stack(probs, 1)
        return Draft(tokens=torch.stack(tokens, 1), parents=chain_parents(B, K, device), draft_probs=draft_probs)

    def commit(self, info: CommitInfo, target_out: TargetOutput) -> None:
        n, n_host = info.num_accepted, info.num_accepted_list
        if self.tree is None:
            K = self._drafted
            if K == 0:
                return  # nothing was drafted; the deferred root stays pending
            # Drafts d_0..d_{K-2} were run through the drafter; the accepted ones stay.
            kept = n.clamp(max=max(K - 1, 0))
            self.runner.advance(kept, [min(a, max(K - 1, 0)) for a in n_host])
            full = (n == K) & (K > 0)
            if K > 0 and any(a == K for a in n_host):
                self.pending = info.accepted_tokens[:, K - 1 : K]
                self.pending_count = full.long()
                self.pending_host = [int(a == K) for a in n_host]
            else:
                self.pending = n.new_zeros(n.shape[0], 0)
                self.pending_count = n.new_zeros(n.shape[0])
                self.pending_host = [0] * len(n_host)
        elif self._drafted == 0 and self.adaptive:
            return  # a plain step (no nodes): the deferred root stays pending
        else:
            width = max(n_host) if n_host else 0
            self.pending = info.accepted_tokens[:, :width].clamp_min(0)
            self.pending_count = n
            self.pending_host = list(n_host)

    def select_rows(self, rows: torch.Tensor, rows_host: list[int]) -> None:
        if self._prefill_args is not None:
            ids, mask, slots = self._prefill_args
            self._prefill_args = (ids.index_select(0, rows), mask.index_select(0, rows), slots)
        else:
            self.runner.select_rows(rows, rows_host)
        self._flush()
        self.pending = self.pending.index_select(0, rows)
        self.pending_count = self.pending_count.index_select(0, rows)
        self.pending_host = [self.pending_host[r] for r in rows_host]

    def set_stop_tokens(self, token_ids) -> None:
        """The loop's EOS ids: a chain ends once every row has drafted one (drafters/chain_stop.py)."""
        self._stop.set(token_ids)

    @property
    def cappable(self) -> bool:
        """Whether the loop may shorten a step's chain (`cap_draft_length`): chains of dynamic
        length only (a tree's shape and a static forward's query count are fixed)."""
        return self.tree is None and not self.static

    def cap_draft_length(self, cap: int) -> None:
        """At most `cap` drafts this step: what the longest row can still emit (r tokens left:
        r - 1 drafts) or the room before a position table's end, whichever is less (the cap
        lasts until the next call or request)."""
        if not self.cappable:
            raise ValueError("cap_draft_length needs a chain drafter with dynamic shapes (no tree, static=False)")
        self._cap = int(cap)

    def set_draft_length(self, k: int) -> None:
        """The loop's choice of K for the next step (adaptive drafters only)."""
        top = self.num_draft_tokens if self.tree is None else self.tree.num_nodes
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= top:
            raise ValueError(f"draft length must be an int in 0..{top}, got {k!r}")
        self.k = k

    # ---- internals -------------------------------------------------------------------------
    def _defer(self, roots: torch.Tensor) -> None:
        """Keep a plain step's roots for the next catch-up (no forward, no tensor work: a plain
        step of `auto` should cost what plain decoding does; `_flush` appends them at once)."""
        self._deferred.append(roots)

    def _flush(self) -> None:
        """Append the deferred roots to each row's pending tokens, the stretch at once (drafters/plain_stretch.py)."""
        if not self._deferred:
            return
        n = len(self._deferred)
        new = torch.stack(self._deferred, 1)  # [B, n]
        self._deferred = []
        self.pending = append_at_counts(self.pending, new, self.pending_count, self.pending.shape[1] + n)
        self.pending_count = self.pending_count + n
        self.pending_host = [c + n for c in self.pending_host]

    # A shadow probe reads the last this-many tokens of each row's plain stretch (and the root).
    shadow_window = 32

    @property
    def shadow_probes(self) -> bool:
        """Whether a probe from plain decoding may be a shadow probe (mmspec/shadow_acceptance.py):
        adaptive chains with dynamic shapes (the loop adds: greedy, a lossless rule)."""
        return self.adaptive and self.tree is None and not self.static

    def _catch_up(self, roots: torch.Tensor, shadow: bool = False) -> torch.Tensor:
        """Run pending tokens + root (after the deferred prompt prefill, if any); returns
        drafter logits [B, V] at the root. `shadow`: logits at every pending token too, whose
        argmax against the next committed token goes to the controller (`observe_shadow`)."""
        if self._prefill_args is not None or self._plain_steps:
            if self.controller is not None:  # one-off work, not the per-step cost of drafting
                self.controller.skip_draft_cost_once()
            if self._prefill_args is not None:
                ids, mask, slots = self._prefill_args
                self.runner.prefill(ids, mask, slots, {})
                self.draft_calls += 1
                self._prefill_args = None
            self._plain_steps = 0
        self._flush()
        B, P = self.pending.shape
        rows = torch.arange(B, device=roots.device)
        tokens = torch.cat([self.pending, roots.new_zeros(B, 1)], 1)
        tokens[rows, self.pending_count] = roots
        vis, depth = chain_visibility(B, P + 1, roots.device)
        # Only each row's root needs logits. When every row has the same number of pending
        # tokens (always at batch 1; after a plain stretch: every row gained one per step) the
        # root is the last query of every row, and the LM head runs on it alone (after a long
        # plain stretch the head over every pending token costs about a target forward).
        aligned = all(c == P for c in self.pending_host)
        if shadow:
            # Logits from column `start` on: each row's last `shadow_window` pending tokens and its
            # root (the LM head over a whole long stretch could cost more than the forward).
            start = max(0, min(self.pending_host) - self.shadow_window)
            out = self.runner.forward(tokens, depth, vis, 0, last_only=P + 1 - start, sees_region=True)
            # The prediction after pending token j against token j + 1 (the root after the last).
            hits = (out.logits[:, :P - start].argmax(-1) == tokens[:, start + 1:]).tolist()  # SYNC: once a shadow
            self.controller.observe_shadow([h[max(0, c - self.shadow_window - start):c - start]
                                            for h, c in zip(hits, self.pending_host)])
            root = out.logits[rows, self.pending_count - start]
        else:
            out = self.runner.forward(tokens, depth, vis, 0, last_only=aligned, queries=self._catch_up_queries,
                                      sees_region=True)
            root = out.logits[:, -1] if aligned else out.logits[rows, self.pending_count]
        self.draft_calls += 1
        self.runner.advance(self.pending_count + 1, [c + 1 for c in self.pending_host])
        return root

    def _propose_tree(self, root_logits: torch.Tensor, sampling: SamplingConfig) -> Draft:
        B, k = root_logits.shape[0], self.tree.top_k

        def expand(frontier_tokens, parent_slot, level, vis, region):
            depth = torch.full((B, k), level - 1, dtype=torch.long, device=root_logits.device)
            self.draft_calls += 1
            return self.runner.forward(frontier_tokens, depth, vis, region).logits  # [B, k, V]

        draft = grow_tree(root_logits, self.tree, expand, num_nodes=self.k if self.adaptive else None,
                          score_dtype=torch.float32, **self._tree_noise(self.tree.depth, sampling, torch.float32))
        self._drafted = draft.tokens.shape[1]
        return draft
