"""Drafters as diffusers pipeline components, and plain decoding through the same loop.

`DrafterComponent` (a diffusers `ModelMixin` + `ConfigMixin`, so it saves and loads like any
pipeline component) holds the trainable part of one of mmspec's VLM drafters:

- `kind="text"`: a small causal LM sharing the target's tokenizer (`ModelDrafter`);
- `kind="eagle"`: an EAGLE-2 head (`EagleHeadDrafter`; embedding and LM head are the target's);
- `kind="vispec"`: an EAGLE head with ViSpec's vision adaptor (`ViSpecDrafter`);
- `kind="flash"`: FLASH's semi-autoregressive head over pooled image latents (`FlashDrafter`;
  chains of at most its `slots` tokens, no trees).

`num_draft_tokens` is a fixed chain length or `"auto"` (the loop picks K in
0..`max_draft_tokens`, default 8 for a text drafter (`ModelDrafter`'s), 6 for a head and a FLASH head's slots, per step from measured costs and acceptance; mmspec/adaptive.py;
`max_draft_tokens` with a fixed length is refused). A tree drafter (`tree_depth > 0`) verifies
`tree_num_nodes` nodes per step, or with `tree_num_nodes="auto"` a size chosen per request from
measured speed (0 = plain decoding up to min(24, top_k + (depth - 1) * top_k^2); `TreeConfig(num_nodes="auto")`).

`build(target)` returns the runtime drafter for a target (checking that the head was built
for it: width, vocabulary, image token). `PlainDecoding` drafts nothing, so
`speculative=False` runs plain decoding through the same target code.
"""

from __future__ import annotations

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config

from mmspec.drafters import EagleHeadConfig, EagleHeadDrafter, ModelDrafter, NullDrafter, ViSpecDrafter
from mmspec.drafters.eagle_head import head_class
from mmspec.drafters.model_drafter import check_max_draft_tokens
from mmspec.models.strict_load import strict_from_pretrained
from mmspec.types import TreeConfig

KINDS = ("text", "eagle", "vispec", "flash")


class DrafterComponent(ModelMixin, ConfigMixin):
    config_name = "config.json"

    @register_to_config
    def __init__(self, kind: str = "eagle", head_config: dict | None = None, lm_config: dict | None = None,
                 num_draft_tokens: int | str = 4, tree_depth: int = 0, tree_top_k: int = 0,
                 tree_num_nodes: int | str = 0, max_draft_tokens: int | None = None):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"drafter kind must be one of {KINDS}, got {kind!r}")
        if tree_num_nodes == "auto" and not tree_depth:
            raise ValueError("tree_num_nodes='auto' chooses a tree's size: it needs tree_depth > 0")
        if tree_depth:
            TreeConfig(tree_depth, tree_top_k, tree_num_nodes)  # TypeError / ValueError naming a bad field
        elif tree_top_k or tree_num_nodes:  # a chain drafter: they would be ignored
            raise ValueError(f"tree_top_k={tree_top_k!r} / tree_num_nodes={tree_num_nodes!r} describe a tree, but "
                             "tree_depth is 0 (a chain drafter); set tree_depth > 0 for a tree drafter, or leave them 0")
        if num_draft_tokens == "auto" and tree_depth:
            raise ValueError("num_draft_tokens='auto' is for chains; a tree drafter (tree_depth > 0) drafts tree_num_nodes")
        if tree_depth and num_draft_tokens != 4:  # (4: the default, saved with every drafter)
            raise ValueError(f"num_draft_tokens={num_draft_tokens!r} has no effect on a tree drafter (tree_depth > 0 "
                             "drafts tree_num_nodes nodes): leave it at its default")
        if kind != "text" and lm_config:
            raise ValueError(f"lm_config describes a text drafter's LM; a {kind} drafter takes head_config")
        if num_draft_tokens != "auto" and (isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int)
                                           or num_draft_tokens < 1):
            raise ValueError(f"num_draft_tokens must be an int >= 1 or 'auto', got {num_draft_tokens!r}")
        check_max_draft_tokens(num_draft_tokens, max_draft_tokens, default=6, tree=tree_depth or None)
        if kind == "flash":  # FlashDrafter's limits, at construction (before the weights load)
            from mmspec.drafters.flash import check_flash_chain

            check_flash_chain((head_config or {}).get("slots", 1), num_draft_tokens, max_draft_tokens, tree_depth)
        if kind == "text":
            from transformers import AutoConfig, AutoModelForCausalLM

            if not lm_config:
                raise ValueError("a text drafter needs lm_config (the causal LM's config as a dict)")
            cfg = dict(lm_config)
            self.lm = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
        else:
            if not head_config:
                raise ValueError(f"a {kind} drafter needs head_config (EagleHeadConfig fields)")
            self.head = head_class(kind)(EagleHeadConfig(**{**head_config, "kind": kind}))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """diffusers' loader, strict: a folder with a missing, unexpected or mis-shaped tensor is a
        ValueError naming it (it loaded with that part random: a ViSpec head without fc drafted
        nothing the target accepted). A folder saved before session 59 with a draft length beside a
        tree (never used) loads with the default in its place and a warning naming it."""
        import json
        import os
        import warnings

        config = os.path.join(str(pretrained_model_name_or_path), kwargs.get("subfolder") or "", cls.config_name)
        if os.path.isfile(config) and "num_draft_tokens" not in kwargs:
            saved = json.loads(open(config).read())
            if saved.get("tree_depth") and saved.get("num_draft_tokens", 4) != 4:
                warnings.warn(f"{config}: num_draft_tokens={saved['num_draft_tokens']!r} beside a tree (tree_depth > 0) "
                              "was never used; loaded as the default 4 (save again to drop it)", stacklevel=2)
                kwargs["num_draft_tokens"] = 4
        return strict_from_pretrained(super().from_pretrained, cls.__name__, pretrained_model_name_or_path, *args, **kwargs)

    @classmethod
    def from_head(cls, head, num_draft_tokens: int | str | None = None, tree: TreeConfig | None = None) -> "DrafterComponent":
        """A component of a trained head: a chain of `num_draft_tokens` (default 4, a FLASH head's
        slots) or `tree`."""
        from dataclasses import asdict

        if num_draft_tokens is None and tree is None and head.config.kind == "flash":
            num_draft_tokens = head.config.slots  # a FLASH head drafts its slots a step
        comp = cls(kind=head.config.kind, head_config=asdict(head.config),
                   num_draft_tokens=_chain_length(num_draft_tokens, tree), **_tree_fields(tree))
        comp.head.load_state_dict(head.state_dict())
        return torch.nn.Module.to(comp, next(head.parameters()).dtype)

    @classmethod
    def from_lm(cls, lm, num_draft_tokens: int | str | None = None, tree: TreeConfig | None = None) -> "DrafterComponent":
        cfg = lm.config.to_dict()
        keep = {k: v for k, v in cfg.items() if not k.startswith("_") and k not in ("architectures", "dtype",
                                                                                   "torch_dtype", "transformers_version")}
        keep["tie_word_embeddings"] = False  # saved as two tensors (safetensors refuses shared ones)
        comp = cls(kind="text", lm_config=keep, num_draft_tokens=_chain_length(num_draft_tokens, tree), **_tree_fields(tree))
        comp.lm.load_state_dict(lm.state_dict())
        return torch.nn.Module.to(comp, next(lm.parameters()).dtype)

    @property
    def tree(self) -> TreeConfig | None:
        c = self.config
        return TreeConfig(c.tree_depth, c.tree_top_k, c.tree_num_nodes) if c.tree_depth else None  # "auto": adaptive

    def build(self, target):
        """The runtime drafter for `target` (an `HFTarget`); ValueError if built for another target."""
        K, tree = self.config.num_draft_tokens, self.tree
        if self.config.kind == "text":
            if self.lm.config.get_text_config().vocab_size != target.vocab_size:
                raise ValueError(f"text drafter vocabulary {self.lm.config.get_text_config().vocab_size} differs from "
                                 f"the target's {target.vocab_size}; it was trained for another target")
            if tree:
                return ModelDrafter(self.lm, tree=tree)
            return ModelDrafter(self.lm, K, max_draft_tokens=self.config.max_draft_tokens)
        from mmspec.drafters.flash import FlashDrafter

        cls = {"vispec": ViSpecDrafter, "flash": FlashDrafter}.get(self.config.kind, EagleHeadDrafter)
        return cls(target, self.head, None if tree else K, tree=tree, max_draft_tokens=self.config.max_draft_tokens)


def _chain_length(num_draft_tokens, tree) -> int | str:
    """The saved chain length: 4 unless given; with a tree it is not used and may not be given."""
    if tree is not None and num_draft_tokens is not None:
        raise ValueError(f"num_draft_tokens={num_draft_tokens!r} has no effect with tree= (a tree drafts "
                         "tree.num_nodes nodes): leave it out")
    return 4 if num_draft_tokens is None else num_draft_tokens


def _tree_fields(tree: TreeConfig | None) -> dict:
    if tree is None:
        return {}
    nodes = tree.num_nodes
    if tree.adaptive:  # saved as "auto", which rebuilds the default largest tree
        if TreeConfig(tree.depth, tree.top_k, "auto").num_nodes != nodes:
            raise ValueError(f"a saved drafter keeps an adaptive tree as tree_num_nodes='auto' (largest "
                             f"min(24, the tree's candidates)); TreeConfig(num_nodes={nodes}, adaptive=True) has another largest "
                             "size: use TreeConfig(num_nodes='auto') or a fixed num_nodes")
        nodes = "auto"
    return {"tree_depth": tree.depth, "tree_top_k": tree.top_k, "tree_num_nodes": nodes}


# Plain decoding through the same loop: the drafter that drafts nothing (shared with the
# image pipeline).
PlainDecoding = NullDrafter
