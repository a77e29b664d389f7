"""Train the testbed VLM: a LLaVA-architecture captioner / VQA model and its three drafters, on CPU.

What (``mmspec testbed train-vlm --out DIR``), in stages that each save their result under
``--work`` (default ``OUT_work``) so any stage can be rerun alone (``--stages``):

1. ``data``: ``n_train`` training and ``n_val`` validation scenes of the default world (1-3
   objects, all backgrounds), preprocessed once by the model's own ``CLIPImageProcessor``
   (64 px scenes unresampled, patch 8: 8 x 8 = 64 visual tokens by default; the first
   bundle used ``--image-size 60 --patch-size 10``, 36 tokens), with per-patch labels,
   per-object coverage masks and classes, and per-scene labels (present colour x shape pairs,
   object count), all read off the scene attributes (``mmspec.testbed.vlm_tower``).
2. ``tower``: a ``CLIPVisionModel`` (the LLaVA vision tower) pretrained on those labels
   (``vlm_tower.stage_tower``): per-patch classes, presence and count, and (weight
   ``tower_object_weight``, 1 by default, 0 = off) per-object classes from the object's pooled
   patches, on the features LLaVA reads (last layer, CLS dropped).
3. ``lm``: ``LlavaForConditionalGeneration`` (that tower, a 2-layer GELU projector, a Llama LM
   that is deeper than wide) trained teacher-forced on captions and Q/A sampled from the
   world's grammar (several valid phrasings each, so the model's next-token distribution is
   genuinely multimodal); loss on the answer tokens and EOS, shape words weighted
   ``lm_shape_weight``. The tower is frozen except its last ``lm_tower_layers`` layers (learning
   rate x ``lm_tower_lr_scale``): the frozen part's output is computed once and cached, so a
   step costs those layers + projector + LM; ``lm_pack`` > 1 puts that many examples of a scene in
   one row behind one copy of its image (``vlm_pack.py``). The pipeline folder (target + ``LlavaProcessor``
   with the word-level tokenizer and a chat template) is saved.
4. ``tune``: ``tune_steps`` more steps from the LM stage's model (kept as ``pipeline_lm``) with
   half the Q/A examples existence questions, learning rate ``tune_lr`` decaying to 0
   (``mmspec.testbed.vlm_tune``: the LM stage alone answered every existence question "yes").
   ``--tune-from DIR`` tunes a saved pipeline instead (how the session-17 bundle was made from
   the session-14 one); ``--tune-steps 0`` skips the stage.
5. ``text`` / ``eagle`` / ``vispec`` / ``flash``: the drafters, by ``mmspec train-drafter``'s own code
   (``pipelines.train_drafter``: the target's regenerated answers, online distillation), on
   the answers to ``drafter_images`` scenes for ``drafter_steps`` steps, the learning rate on a
   cosine after ``drafter_warmup`` warm-up steps (session 23: 8192 scenes, 12000 steps, cosine
   took ViSpec from 2.88 to 3.11 tokens per target forward in the eval, ~9 min a drafter on
   2 cores, against 4096 / 4000 / constant). The FLASH head drafts ``num_draft_tokens`` tokens
   per forward (its ``slots``) and pools each image into ``flash_compress_len`` tokens.
6. ``eval``: caption correctness and VQA accuracy on ``n_val`` validation scenes
   (``mmspec.testbed.vlm_eval``), each drafter's mean accepted length on ``accept_scenes``
   validation scenes (captions and questions, greedy, speculative == plain checked); the
   drafter with the highest mean accepted length becomes the default; the pipeline is saved to
   ``--out`` in float16 with ``metrics.json`` and ``train_log.json``.

Why (issue 13's measurements: a 6.8M LLaVA with 64 visual tokens captioned 17% of scenes right
after 11 CPU minutes; visual tokens were ~45% of its compute): a tower pretrained densely on
the world's labels (it learns *where* each coloured shape is, not only the main class), mostly
frozen with cached features (the LM stage pays little for vision), and a narrow deep LM so a
target forward costs several 1-layer drafter steps. The options added after the second
bundle (patch 8 at 64 px, the per-object target, the shape-word weight, a trained top tower
layer) target its weakness, a small secondary object's shape named at chance level; the
defaults are the bundled run's settings (the history of each choice: assets/testbed/README.md).

Limits: a toy VLM for the toy world; figures hold for seed 0 on the machine that ran it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mmspec.testbed.vlm_train_checks import check_config
from mmspec.testbed.bundle_paths import drop_machine_paths
from mmspec.testbed.vlm_data import stage_data
from mmspec.testbed.vlm_pack import draw_example, packed_batch, sample_packs
from mmspec.testbed.vlm_tower import stage_tower
from mmspec.testbed.vlm_tune import stage_tune

STAGES = ("data", "tower", "lm", "tune", "text", "eagle", "vispec", "flash", "eval")
DRAFTERS = ("text", "eagle", "vispec", "flash")
CAPTION_PROMPT = "what is in the image ?"
CHAT_TEMPLATE = ("{% for message in messages %}{% for c in message['content'] %}{% if c['type'] == 'image' %}"
                 "<image> {% endif %}{% endfor %}{% for c in message['content'] %}{% if c['type'] == 'text' %}"
                 "{{ c['text'] }} {% endif %}{% endfor %}{% endfor %}{% if add_generation_prompt %}:{% endif %}")


@dataclasses.dataclass(frozen=True)
class VLMTrainConfig:
    """Every field maps 1:1 to a CLI option of `mmspec testbed train-vlm`."""

    seed: int = 0
    threads: int = 1
    device: str = "cpu"
    # data
    n_train: int = 108000  # session 27 (36000 until then): the tower overfit 36000 scenes (assets/testbed/README.md)
    n_val: int = 200
    image_size: int = 64  # processor crop; the scenes are rendered at this size (no resampling)
    patch_size: int = 8
    # "default": LLaVA drops the tower's CLS token; "full" (the default since session 21): keeps it as one
    # more visual token, which the tower stage trains to carry the scene's set of objects and their count
    # (vlm_tower.py); with it the LM answers existence questions from the image on every draw tried
    vision_feature_select_strategy: str = "full"
    # vision tower + its pretraining
    tower_dim: int = 128
    tower_layers: int = 4
    tower_heads: int = 4
    # 12000 since session 37 (6000 before): on the 108000 scenes the longer-trained tower took the LM's
    # caption shape errors on 2000 validation scenes from 265 to 119, captions 75.8% -> 83.0% (assets/testbed/README.md)
    tower_steps: int = 12000
    tower_object_weight: float = 1.0  # weight of the per-object colour x shape loss (0 = off)
    tower_batch: int = 64
    tower_lr: float = 2e-3
    # language model
    lm_dim: int = 128
    lm_layers: int = 8
    lm_heads: int = 4
    lm_ffn: int = 384
    lm_steps: int = 5000
    lm_batch: int = 32  # rows per step (each of lm_pack examples)
    lm_pack: int = 1  # examples of one scene per row, sharing its image tokens (vlm_pack.py)
    lm_lr: float = 2e-3
    lm_shape_weight: float = 1.0  # loss weight of shape-word targets in the LM stage
    # share of the LM stage's Q/A examples drawn from existence questions (0 = all alike); 0.8 since
    # session 27 (0.5 before): at 0.5 the LM over the 108000-scene tower stayed on the answer-"yes" plateau
    lm_exists_fraction: float = 0.8
    lm_tower_layers: int = 0  # last tower layers trained in the LM stage (0 = tower frozen)
    lm_tower_lr_scale: float = 0.25  # their learning rate relative to lm_lr
    warmup: int = 60
    caption_fraction: float = 0.5
    caption_order: str = "main_first"  # order of objects in training captions (language.CAPTION_ORDERS)
    # look-up tuning (vlm_tune.py; 0 steps = skip)
    tune_steps: int = 2000
    tune_lr: float = 5e-4
    tune_exists_fraction: float = 0.5  # share of the Q/A examples drawn from existence questions
    tune_from: str = ""  # a saved pipeline to tune instead of the LM stage's model
    tune_tower_layers: int = 0  # last tower layers trained in the tune stage (lr x lm_tower_lr_scale; 0 = frozen)
    # drafters (pipelines.train_drafter)
    drafter_images: int = 8192
    drafter_steps: int = 12000
    drafter_batch: int = 8
    drafter_lr: float = 1e-3
    drafter_lr_schedule: str = "cosine"  # "constant" or "cosine" (train-drafter's --lr-schedule)
    drafter_warmup: int = 200
    answer_tokens: int = 40
    num_draft_tokens: int = 5
    flash_compress_len: int = 8  # FLASH: tokens each image's 65 visual tokens are pooled into
    # evaluation
    accept_scenes: int = 32
    max_new_tokens: int = 40
    progress: bool = True

    def __post_init__(self):
        check_config(self)  # mmspec/testbed/vlm_train_checks.py

    @property
    def num_visual_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + (self.vision_feature_select_strategy == "full")


# ---------------------------------------------------------------------- model + processor
def build_processor(cfg: VLMTrainConfig):
    """LlavaProcessor: slow (PIL) CLIPImageProcessor + the testbed word-level tokenizer + chat template.
    The tokenizer prepends <bos> and does not append <eos> (prompts continue into answers)."""
    from tokenizers import processors
    from transformers import CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast

    from mmspec.testbed.language import IMAGE_TOKEN, SPECIAL_TOKENS, build_tokenizer

    base = build_tokenizer()
    backend = base.backend_tokenizer
    bos = SPECIAL_TOKENS["bos_token"]
    backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                           special_tokens=[(bos, base.convert_tokens_to_ids(bos))])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, model_max_length=256,
                                  extra_special_tokens={"image_token": IMAGE_TOKEN}, **SPECIAL_TOKENS)
    size = cfg.image_size
    image_proc = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    return LlavaProcessor(image_processor=image_proc, tokenizer=tok, patch_size=cfg.patch_size,
                          image_token=IMAGE_TOKEN,
                          vision_feature_select_strategy=cfg.vision_feature_select_strategy,
                          num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE)


def build_model(cfg: VLMTrainConfig, vocab_size: int, image_token_id: int):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(hidden_size=cfg.tower_dim, intermediate_size=2 * cfg.tower_dim,
                              num_hidden_layers=cfg.tower_layers, num_attention_heads=cfg.tower_heads,
                              image_size=cfg.image_size, patch_size=cfg.patch_size, projection_dim=cfg.tower_dim)
    text = LlamaConfig(vocab_size=vocab_size, hidden_size=cfg.lm_dim, intermediate_size=cfg.lm_ffn,
                       num_hidden_layers=cfg.lm_layers, num_attention_heads=cfg.lm_heads,
                       num_key_value_heads=cfg.lm_heads, max_position_embeddings=256, pad_token_id=0,
                       bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token_id,
                         vision_feature_layer=-1,
                         vision_feature_select_strategy=cfg.vision_feature_select_strategy,
                         projector_hidden_act="gelu", image_seq_length=cfg.num_visual_tokens)
    torch.manual_seed(cfg.seed)
    model = LlavaForConditionalGeneration(config)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    model.generation_config.bos_token_id = 1
    return model


def _select(model, states: torch.Tensor) -> torch.Tensor:
    """LLaVA's feature selection: CLS dropped ("default") or kept ("full")."""
    return states[:, 1:] if model.config.vision_feature_select_strategy == "default" else states


def tower_features(model, pixel_values: torch.Tensor) -> torch.Tensor:
    """What LLaVA reads from its tower: last hidden layer, CLS dropped ("default") or first
    ("full") ([B, tokens, dim])."""
    out = model.model.vision_tower(pixel_values, output_hidden_states=True)
    return _select(model, out.hidden_states[-1])


def top_tower_layers(model, n: int) -> list:
    """The last ``n`` encoder layers of the tower (trained in the LM stage when n > 0)."""
    layers = model.model.vision_tower.encoder.layers
    return list(layers[len(layers) - n:]) if n else []


def lm_optimiser(model, n_top: int, lr: float, tower_lr_scale: float):
    """(AdamW, params): the trainable parameters + the tower's last ``n_top`` layers (lr x ``tower_lr_scale``)."""
    top = [p for layer in top_tower_layers(model, n_top) for p in layer.parameters()]
    for p in top:
        p.requires_grad_(True)
    rest = [p for p in model.parameters() if p.requires_grad and all(p is not q for q in top)]
    optim = torch.optim.AdamW([{"params": rest, "scale": 1.0}, {"params": top, "scale": tower_lr_scale}],
                              lr=lr, weight_decay=0.01)
    return optim, rest + top


def tower_states(model, pixel_values: torch.Tensor, n_top: int) -> torch.Tensor:
    """Hidden states entering the last ``n_top`` tower layers, CLS kept ([B, 1 + tokens, dim])."""
    return model.model.vision_tower(pixel_values, output_hidden_states=True).hidden_states[-1 - n_top]


def finish_tower(model, states: torch.Tensor, n_top: int) -> torch.Tensor:
    """Run the last ``n_top`` tower layers on ``tower_states`` and select: ``tower_features``."""
    for layer in top_tower_layers(model, n_top):
        states = layer(states, None)
        states = states[0] if isinstance(states, tuple) else states
    return _select(model, states)


# ---------------------------------------------------------------------- stage: tower (vlm_tower.py)
def lr_at(step: int, total: int, base: float, warmup: int) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    t = (step - warmup) / max(total - warmup, 1)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


# ---------------------------------------------------------------------- stage: lm
def sample_examples(data: dict, tok, rng: random.Random, caption_fraction: float,
                    exists_fraction: float) -> list[tuple[int, list, list]]:
    """One (scene, prompt ids after the image, answer ids + EOS) per scene per epoch, sampled: a
    caption with probability ``caption_fraction``, else a question; of the questions a share
    ``exists_fraction`` (0 = every question alike) drawn from the scene's existence questions
    ("is there a violet disc ?")."""
    out = [(i, *draw_example(caps, qa, rng, caption_fraction, exists_fraction, CAPTION_PROMPT))
           for i, (caps, qa) in enumerate(zip(data["captions"], data["qa"]))]
    return tokenize_examples(out, tok)


def encode_examples(data: dict, tok, rng: random.Random, cfg: VLMTrainConfig) -> list[tuple[int, list, list]]:
    """The LM stage's epoch: ``sample_examples`` with ``caption_fraction`` and ``lm_exists_fraction``
    (``lm_pack`` > 1: rows of that many examples of one scene, ``vlm_pack.sample_packs``)."""
    if cfg.lm_pack > 1:
        return sample_packs(data, tok, rng, cfg.caption_fraction, cfg.lm_exists_fraction, cfg.lm_pack, CAPTION_PROMPT)
    return sample_examples(data, tok, rng, cfg.caption_fraction, cfg.lm_exists_fraction)


def tokenize_examples(chosen: list[tuple[int, str, str]], tok) -> list[tuple[int, list, list]]:
    """(scene, prompt, answer) strings -> (scene, prompt ids after the image, answer ids + EOS)."""
    p_ids = tok([p + " :" for _, p, _ in chosen], add_special_tokens=False)["input_ids"]
    a_ids = tok([a for _, _, a in chosen], add_special_tokens=False)["input_ids"]
    return [(i, p, a + [tok.eos_token_id]) for (i, _, _), p, a in zip(chosen, p_ids, a_ids)]


def lm_update(model, optim, params, batch, states, tok, image_id: int, cfg: VLMTrainConfig, n_top: int,
              weight_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """One teacher-forced optimiser step of the LM stages on `batch`; (weighted loss, plain loss)."""
    if cfg.lm_pack > 1:  # rows of lm_pack examples sharing one image (vlm_pack.py)
        ids, mask, pos, labels, f = packed_batch(batch, states, [tok.bos_token_id], image_id, tok.pad_token_id,
                                                 cfg.num_visual_tokens)
    else:
        ids, mask, labels, f = lm_batch(batch, states, [tok.bos_token_id], image_id, tok.pad_token_id,
                                        cfg.num_visual_tokens)
        pos = None
    loss, plain = lm_loss(model, ids.to(cfg.device), mask.to(cfg.device), labels.to(cfg.device),
                          f.to(cfg.device), image_id, n_top, weight_ids, cfg.lm_shape_weight,
                          None if pos is None else pos.to(cfg.device))
    optim.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optim.step()
    return loss, plain


def lm_batch(examples, feats, head_ids, image_id, pad_id, n_visual: int):
    """Right-padded ids [B, L], labels (-100 off the answer), and the cached tower states."""
    rows = [head_ids + [image_id] * n_visual + p + a for _, p, a in examples]
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for b, ((_, p, a), r) in enumerate(zip(examples, rows)):
        ids[b, :len(r)] = torch.tensor(r)
        mask[b, :len(r)] = 1
        labels[b, len(r) - len(a):len(r)] = torch.tensor(a)
    return ids, mask, labels, feats[[i for i, _, _ in examples]].float()


def shape_word_ids(tok) -> list[int]:
    """The token that decides a shape word (the first of each synonym, e.g. "round" of "round shape")."""
    from mmspec.testbed.language import SHAPE_WORDS

    return sorted({tok(w, add_special_tokens=False)["input_ids"][0] for ws in SHAPE_WORDS.values() for w in ws})


def lm_loss(model, ids, mask, labels, states, image_id, n_top: int, weight_ids, weight: float, position_ids=None):
    """(training loss, plain answer-token CE). The training loss weights the targets in ``weight_ids``
    (shape words) by ``weight``: each token's own conditional is still what it fits, the emphasis
    only steers the gradient towards the words that need the image's small objects."""
    image = model.model.multi_modal_projector(finish_tower(model, states, n_top))
    embeds = model.get_input_embeddings()(ids)
    embeds = embeds.masked_scatter((ids == image_id).unsqueeze(-1), image.to(embeds.dtype))
    hidden = model.model.language_model(inputs_embeds=embeds, attention_mask=mask,
                                        position_ids=position_ids).last_hidden_state
    logits = model.lm_head(hidden[:, :-1])
    target = labels[:, 1:].flatten()
    ce = F.cross_entropy(logits.flatten(0, 1), target, ignore_index=-100, reduction="none")
    live = (target != -100).float()
    w = live * (1 + (weight - 1) * torch.isin(target, weight_ids).float())
    return (ce * w).sum() / w.sum(), (ce * live).sum() / live.sum()


@torch.no_grad()
def cache_states(model, pixels: torch.Tensor, device, n_top: int, batch: int = 256) -> torch.Tensor:
    return torch.cat([tower_states(model, pixels[i:i + batch].float().to(device), n_top).half().cpu()
                      for i in range(0, len(pixels), batch)])


def check_layout(processor, tok, image) -> None:
    """The training sequences are built like the processor builds them (no silent mismatch)."""
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                          "text": CAPTION_PROMPT}]}], add_generation_prompt=True)
    ref = processor(images=[image], text=[text], return_tensors="pt")["input_ids"][0].tolist()
    n_img = ref.count(tok.convert_tokens_to_ids(processor.image_token))
    mine = [tok.bos_token_id] + [tok.convert_tokens_to_ids(processor.image_token)] * n_img + \
        tok(CAPTION_PROMPT + " :", add_special_tokens=False)["input_ids"]
    if ref != mine:
        raise RuntimeError(f"training layout {mine} differs from the processor's {ref}")


def stage_lm(cfg: VLMTrainConfig, work: Path, log: dict) -> dict:
    from tqdm import tqdm
    from transformers import AutoProcessor

    from mmspec.pipelines.vlm import SpeculativeVLMPipeline
    from mmspec.testbed.world import World

    processor = AutoProcessor.from_pretrained(work / "processor")
    tok = processor.tokenizer
    image_id = tok.convert_tokens_to_ids(processor.image_token)
    check_layout(processor, tok, World(seed=cfg.seed, split="validation", image_size=cfg.image_size).scene(0).image)
    train = torch.load(work / "data_train.pt", weights_only=False, mmap=True)  # pixels read from disk as used
    model = build_model(cfg, len(tok), image_id).to(cfg.device)
    model.model.vision_tower.load_state_dict(torch.load(work / "tower.pt"))
    model.model.vision_tower.requires_grad_(False).eval()
    n_top = cfg.lm_tower_layers  # the tower below them is frozen: its output is computed once
    states = cache_states(model, train["pixels"], cfg.device, n_top)
    check_pixels = train["pixels"][:8].float()
    del train["pixels"]
    optim, params = lm_optimiser(model, n_top, cfg.lm_lr, cfg.lm_tower_lr_scale)
    weight_ids = torch.tensor(shape_word_ids(tok), device=cfg.device)
    rng = random.Random(cfg.seed + 2)
    model.train()
    model.model.vision_tower.eval()  # no dropout in the tower; its top layers still train
    log["lm"] = []
    pool: list = []
    bar = tqdm(range(cfg.lm_steps), desc="lm", disable=not cfg.progress)
    for step in bar:
        if len(pool) < cfg.lm_batch:
            epoch = encode_examples(train, tok, rng, cfg)
            rng.shuffle(epoch)
            pool += epoch
        batch, pool = pool[:cfg.lm_batch], pool[cfg.lm_batch:]
        for g in optim.param_groups:
            g["lr"] = lr_at(step, cfg.lm_steps, cfg.lm_lr, cfg.warmup) * g["scale"]
        loss, plain = lm_update(model, optim, params, batch, states, tok, image_id, cfg, n_top, weight_ids)
        bar.set_postfix(loss=f"{float(plain.detach()):.3f}")
        if step % 25 == 0 or step == cfg.lm_steps - 1:
            log["lm"].append({"step": step, "loss": float(plain.detach()), "weighted_loss": float(loss.detach())})
    model.eval()
    with torch.no_grad():  # the cached split computes exactly what the saved tower computes
        full = tower_features(model, check_pixels.to(cfg.device))
        split = finish_tower(model, tower_states(model, check_pixels.to(cfg.device), n_top), n_top)
    if not torch.allclose(full, split, atol=1e-4, rtol=1e-4):
        raise RuntimeError("the LM stage's cached tower states do not reproduce the tower's features")
    model.cpu()
    pipe = SpeculativeVLMPipeline(model, processor, caption_prompt=CAPTION_PROMPT)
    for old in (work / "pipeline", work / "pipeline_lm"):  # pipeline_lm: the tune stage's copy of an older run
        if old.exists():
            shutil.rmtree(old)
    pipe.save_pretrained(work / "pipeline")
    (work / "drafter_data.pt").unlink(missing_ok=True)  # an older target's answers: the drafters regenerate them
    return {"final_train_loss": log["lm"][-1]["loss"],
            "parameters": {"vision_tower": sum(p.numel() for p in model.model.vision_tower.parameters()),
                           "projector": sum(p.numel() for p in model.model.multi_modal_projector.parameters()),
                           "language_model": sum(p.numel() for p in model.model.language_model.parameters())
                           + model.lm_head.weight.numel()}}


# ---------------------------------------------------------------------- stage: drafters
def drafter_config(cfg: VLMTrainConfig, work: Path, kind: str):
    from mmspec.pipelines.train_config import TrainDrafterConfig

    return TrainDrafterConfig(pipeline=str(work / "pipeline"), drafter=kind, out=str(work / f"drafter_{kind}"),
                              num_images=cfg.drafter_images, answer_tokens=cfg.answer_tokens,
                              steps=cfg.drafter_steps, batch_size=cfg.drafter_batch, lr=cfg.drafter_lr,
                              lr_schedule=cfg.drafter_lr_schedule, warmup_steps=cfg.drafter_warmup,
                              num_draft_tokens=cfg.num_draft_tokens, device=cfg.device,
                              slots=cfg.num_draft_tokens, compress_len=cfg.flash_compress_len,
                              save_every=max(cfg.drafter_steps // 4, 1), seed=cfg.seed, progress=cfg.progress)


def stage_drafter(cfg: VLMTrainConfig, work: Path, log: dict, kind: str) -> dict:
    from mmspec.pipelines.train_drafter import load_data, load_target_pipeline, target_identity, train_drafter

    dc = drafter_config(cfg, work, kind)
    out = Path(dc.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    shared = work / "drafter_data.pt"  # the target's regenerated answers: the same for every drafter
    if shared.is_file():
        try:  # (the key holds the target's fingerprint: answers of a retrained LM are regenerated)
            load_data(shared, dc, cfg.image_size, target_identity(load_target_pipeline(dc.pipeline).target))
            shutil.copy(shared, out / "data.pt")
        except ValueError:  # regenerated for other --drafter-images / --answer-tokens / --image-size: regenerate
            shared.unlink()
    result = train_drafter(dc)
    if not shared.is_file():
        shutil.copy(out / "data.pt", shared)
    (out / "data.pt").unlink()
    (out / "checkpoint.pt").unlink(missing_ok=True)
    losses = result["losses"]
    log[kind] = [{"step": i, "loss": v} for i, v in enumerate(losses) if i % 10 == 0 or i == len(losses) - 1]
    return {"first_loss": losses[0], "final_loss": losses[-1], "steps": len(losses)}


# ---------------------------------------------------------------------- stage: eval
def load_full(work: Path):
    from mmspec.pipelines.vlm import SpeculativeVLMPipeline
    from mmspec.pipelines.vlm_drafter import DrafterComponent

    pipe = SpeculativeVLMPipeline.from_pretrained(work / "pipeline", dtype=torch.float32)
    for kind in DRAFTERS:
        d = work / f"drafter_{kind}"
        if (d / DrafterComponent.config_name).is_file():
            comp = DrafterComponent.from_pretrained(str(d), low_cpu_mem_usage=False, torch_dtype=torch.float32)
            pipe.add_drafter(kind, comp, active=False)
    return pipe


def accepted_lengths(pipe, scenes, max_new_tokens: int, batch: int = 8) -> dict:
    """Per drafter: mean accepted length over captions + first questions, and speculative == plain."""
    images = [s.image for s in scenes]
    prompts = [None] * len(scenes) + [s.qa[0][0] for s in scenes]
    images = images + images
    plain = pipe(images, prompts, max_new_tokens=max_new_tokens, speculative=False, batch_size=batch)
    out = {}
    for name in sorted(pipe.drafters):
        pipe.load_drafter(name)
        spec = pipe(images, prompts, max_new_tokens=max_new_tokens, batch_size=batch)
        out[name] = {"mean_accepted_length": spec.stats.mean_accepted_length,
                     "identical_to_plain": spec.texts == plain.texts}
    return out


def stage_eval(cfg: VLMTrainConfig, work: Path, out_dir: Path) -> dict:
    from mmspec.testbed.vlm_eval import evaluate
    from mmspec.testbed.world import World

    pipe = load_full(work)
    val = World(seed=cfg.seed, split="validation", image_size=cfg.image_size).sample(cfg.n_val)
    quality = evaluate(pipe, val, max_new_tokens=cfg.max_new_tokens, progress=cfg.progress)
    accept = accepted_lengths(pipe, val[:cfg.accept_scenes], cfg.max_new_tokens) if pipe.drafters else {}
    best = max(accept, key=lambda k: accept[k]["mean_accepted_length"]) if accept else None
    if best:
        pipe.load_drafter(best)
    pipe.target.half()
    for comp in pipe.drafters.values():
        torch.nn.Module.to(comp, torch.float16)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    pipe.save_pretrained(out_dir)
    drop_machine_paths(out_dir)  # the drafters were loaded from `work`: no trainer's path in the bundle
    return {**quality, "accepted_length": accept, "default_drafter": best}


# ---------------------------------------------------------------------- driver
def run(cfg: VLMTrainConfig, out: str | Path, stages=STAGES, work: str | Path | None = None) -> dict:
    out = Path(out)
    work = Path(work) if work else out.with_name(out.name + "_work")
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(cfg.threads)
    record_path, log_path = work / "metrics.json", work / "train_log.json"
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    log = json.loads(log_path.read_text()) if log_path.is_file() else {}
    record["config"] = dataclasses.asdict(cfg)
    for stage in STAGES:
        if stage not in stages:
            continue
        torch.manual_seed(cfg.seed)
        t0 = time.perf_counter()
        if stage == "data":
            result = stage_data(cfg, work)
        elif stage == "tower":
            result = stage_tower(cfg, work, log)
        elif stage == "lm":
            result = stage_lm(cfg, work, log)
        elif stage == "tune":
            result = stage_tune(cfg, work, log)
        elif stage in DRAFTERS:
            result = stage_drafter(cfg, work, log, stage)
        else:
            result = stage_eval(cfg, work, out)
        result["wall_seconds"] = round(time.perf_counter() - t0, 1)
        record[stage] = result
        record_path.write_text(json.dumps(record, indent=2) + "\n")
        log_path.write_text(json.dumps(log) + "\n")
        print(json.dumps({stage: {k: v for k, v in result.items() if k not in ("examples", "per_scene")}}, indent=2),
              flush=True)
    if out.is_dir() and (out / "model_index.json").is_file():
        shutil.copy(record_path, out / "metrics.json")
        shutil.copy(log_path, out / "train_log.json")
    return record


def cmd_train_vlm(args) -> int:
    stages = tuple(s.strip() for s in args.stages.split(",") if s.strip())
    bad = [s for s in stages if s not in STAGES]
    if bad or not stages:  # "--stages ," ran nothing and exited 0
        raise SystemExit(f"mmspec testbed train-vlm: unknown stages {bad}; known: {list(STAGES)}" if bad else
                         f"mmspec testbed train-vlm: --stages names no stage; known: {list(STAGES)}")
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(VLMTrainConfig)
          if getattr(args, f.name, None) is not None}
    kw["progress"] = not args.no_progress
    try:
        cfg = VLMTrainConfig(**kw)
    except ValueError as e:
        raise SystemExit(f"mmspec testbed train-vlm: {e}") from None
    run(cfg, args.out, stages, args.work)
    return 0


def add_vlm_command(subparsers) -> None:
    p = subparsers.add_parser("train-vlm", help="train the testbed VLM (LLaVA) and its text / EAGLE / ViSpec drafters")
    p.add_argument("--out", default="assets/testbed/vlm", help="the pipeline folder written by the eval stage")
    p.add_argument("--work", default=None, help="folder for data, checkpoints and stage results (default OUT_work)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    p.add_argument("--no-progress", action="store_true")
    for f in dataclasses.fields(VLMTrainConfig):
        if f.name == "progress":
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = {"int": int, "float": float, "str": str}[str(f.type)]
        p.add_argument(flag, type=kind, default=None, help=f"default {f.default}")
    p.set_defaults(func=cmd_train_vlm)
