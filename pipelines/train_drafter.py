"""`mmspec train-drafter`: online distillation of a VLM drafter from its target.

    mmspec train-drafter --pipeline DIR --drafter text|eagle|vispec|flash --out DIR [--data DIR] [--steps N]

1. Data: images with prompts (a folder of images, optionally with the testbed's `scenes.jsonl`
   for questions; by default testbed scenes rendered on the fly), and the *target's own greedy
   answers* to them, regenerated once through the pipeline (as EAGLE / ViSpec do: the drafter
   learns the target's distribution, not the dataset's). Only token ids are kept (`data.pt`,
   with the settings they were made for: a resume with other data settings is refused).
2. Teacher signals are computed on the fly at every step (nothing stored): the target's
   final hidden states, its logits, and the decoder's input embeddings (image features merged),
   captured with forward hooks on the language model.
3. Loss (EAGLE, Li et al. 2024; SpecVLM's online-logit distillation): feature heads
   `SmoothL1(f_{t+1}, h_{t+1}) + 0.1 * CE(p_target(t+1), softmax(lm_head(f_{t+1})))` over the
   text pairs; the text drafter `CE(p_target, p_drafter)` (soft labels) over text tokens. The CE
   is reported minus the target's entropy (= KL, 0 at a perfect match; same gradient).
4. Training-time test (HASS, EAGLE-3): `--ttt-steps` extra unrolled forwards in which the head
   reads its *own* predicted features instead of the target's, so that it learns to draft
   from its own outputs (what it does at inference) instead of the shortcut h_t -> h_{t+1}.
   Not for a FLASH head (0 by default, more refused): its placeholders come from the root's
   input, so it never reads its own features.
5. AdamW (learning rate constant, or `--lr-schedule cosine`: a half cosine to 0 at the last
   step, after `--warmup-steps` of linear warm-up), gradient accumulation, bf16 autocast on
   CUDA; `checkpoint.pt` every `--save-every` steps (model, optimiser, RNG) and automatic resume; tqdm progress; losses logged to
   `train_log.jsonl`; the result is a `DrafterComponent` folder loadable with
   `pipe.load_drafter(DIR)`.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from .train_config import TrainDrafterConfig, lr_at


# ---- data ---------------------------------------------------------------------------------------------
def world_image_size(pipe) -> int:
    """The size to render the testbed world's scenes at for ``pipe``: its processor's square crop
    (the testbed VLMs: no resampling), else the world's default 64 (processors that resize freely,
    Qwen2-VL's)."""
    from mmspec.testbed.vlm_eval import scene_size

    try:
        return scene_size(pipe.processor)
    except ValueError:
        return 64


def data_items(config: TrainDrafterConfig, image_size: int = 64) -> list[tuple]:
    """(image, prompt) pairs: prompt None = the pipeline's caption prompt. Without ``config.data``
    the testbed world's training scenes, rendered at ``image_size`` (``world_image_size(pipe)``)."""
    rng = random.Random(config.seed)
    if config.data is None:
        from mmspec.testbed.world import World

        world = World(seed=config.seed, split="train", image_size=image_size)
        items = []
        for i in range(config.num_images):
            scene = world.scene(i)
            q = scene.qa[rng.randrange(len(scene.qa))][0] if scene.qa and i % 2 else None
            items.append((scene.image, q))
        return items
    folder = Path(config.data)
    if not folder.is_dir():
        raise ValueError(f"--data {folder} is not a folder")
    index = folder / "scenes.jsonl"
    if index.is_file():
        rows = []
        for n, line in enumerate(index.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{index} line {n} is not JSON ({e}); each line is one scene "
                                 '{"image": FILE, "qa": [[question, answer], ...]} as `mmspec testbed data` writes') from None
            if not isinstance(row, dict) or not isinstance(row.get("image"), str):
                raise ValueError(f"{index} line {n} names no image (a JSON object with an \"image\" file name)")
            rows.append(row)
        items = [(folder / r["image"], (r["qa"][rng.randrange(len(r["qa"]))][0] if r.get("qa") and i % 2 else None))
                 for i, r in enumerate(rows)]
    else:
        files = sorted(p for p in folder.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg", ".bmp", ".webp"))
        items = [(p, None) for p in files]
    if not items:
        raise ValueError(f"--data {folder} holds no images")
    return items[: config.num_images]


@torch.no_grad()
def regenerate(pipe, items, config: TrainDrafterConfig) -> list[dict]:
    """The target's greedy answers, one encoded example per item (prompt ids + answer ids + image inputs)."""
    from tqdm import tqdm

    examples = []
    bs = config.batch_size
    for start in tqdm(range(0, len(items), bs), desc="regenerate answers", disable=not config.progress):
        chunk = items[start:start + bs]
        out = pipe([im for im, _ in chunk], [p for _, p in chunk], max_new_tokens=config.answer_tokens,
                   speculative=False, batch_size=bs)
        for (image, prompt), answer, err in zip(chunk, out.sequences, out.errors):
            if err is not None:
                raise ValueError(err)
            loaded = pipe._load_images(image)
            enc = pipe.processor(images=loaded, text=[pipe._prompt(prompt, len(loaded))], return_tensors="pt")
            ids = torch.cat([enc["input_ids"][0], answer.cpu()])
            extra = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")
                     and k in pipe._spec_target.spec.forward_params}
            examples.append({"ids": ids, "prompt_len": int(enc["input_ids"].shape[1]), "inputs": extra})
    return examples


def target_identity(model) -> str:
    """A fingerprint of the target whose answers and features a drafter learns: its class, its
    config and a strided sample of every weight (another checkpoint, a fine-tune or another
    precision gives another one; cheap at any size)."""
    import hashlib

    h = hashlib.sha1(type(model).__name__.encode())
    h.update(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            h.update(name.encode())
            h.update(flat[:: max(1, flat.numel() // 256)][:256].double().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def load_target_pipeline(path: str):
    """The pipeline whose target a drafter is trained on, as `train_drafter` loads it (float32)."""
    from .vlm import SpeculativeVLMPipeline

    return SpeculativeVLMPipeline.from_pretrained(path, dtype=torch.float32)


def data_key(config: TrainDrafterConfig, image_size: int = 64, target: str | None = None) -> dict:
    """The settings that decide which answers `data.pt` holds (a resume must not reuse other ones);
    ``image_size``: the size the world's scenes were rendered at (when ``config.data`` is None);
    ``target``: `target_identity` of the model that answered."""
    key = {"data": None if config.data is None else str(config.data), "num_images": config.num_images,
           "answer_tokens": config.answer_tokens, "seed": config.seed, "target": target}
    if config.data is None:
        key["image_size"] = image_size
    return key


def load_data(path: Path, config: TrainDrafterConfig, image_size: int = 64, target: str | None = None) -> list[dict]:
    """`data.pt`'s examples; ValueError when they were regenerated for other settings or by
    another target."""
    saved = torch.load(path, weights_only=False)
    key = saved.get("key") if isinstance(saved, dict) else None
    want = data_key(config, image_size, target)
    if key != want:
        raise ValueError(key_mismatch(path, "holds the answers of another run", key, want))
    return saved["examples"]


def key_mismatch(path: Path, what: str, saved, want: dict) -> str:
    """The message for a data key that differs: which fields, saved and now, and what to do."""
    differ = sorted(k for k in want if not isinstance(saved, dict) or saved.get(k) != want[k])
    was = {k: saved.get(k) for k in differ} if isinstance(saved, dict) else "unrecorded settings"
    return (f"{path} {what} ({differ} differ: saved {was}, this run {dict((k, want[k]) for k in differ)}); delete "
            f"data.pt and checkpoint.pt in {path.parent} (or use another --out) to regenerate the answers and train "
            "afresh")


# Settings a resumed run must share with the checkpoint it continues (they define what each
# step trains); steps (a constant schedule), save_every, the saved drafter's shape, ... may change.
RUN_FIELDS = ("batch_size", "grad_accum", "ttt_steps", "feature_weight", "ce_weight", "text_layers", "slots",
              "compress_len")


def collate(examples: list[dict], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    L = max(len(e["ids"]) for e in examples)
    ids = torch.full((len(examples), L), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    inputs: dict[str, list] = {}
    for b, e in enumerate(examples):
        n = len(e["ids"])
        ids[b, L - n:], mask[b, L - n:] = e["ids"], 1
        for k, v in e["inputs"].items():
            if v.dim() == 2 and v.shape[0] == 1 and v.shape[1] == e["prompt_len"]:  # per-token (mm_token_type_ids)
                row = torch.zeros(1, L, dtype=v.dtype)
                row[0, L - n:L - n + v.shape[1]] = v[0]
                v = row
            inputs.setdefault(k, []).append(v)
    return ids, mask, {k: _cat_padded(v) for k, v in inputs.items()}


def _cat_padded(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along dim 0; LLaVA-NeXT's pixel_values [1, tiles, 3, H, W] differ in their tile
    count per image and are zero-padded to the most tiles, as its processor pads a batch (the
    model reads each image's tiles from its image_sizes)."""
    if len({p.shape for p in parts}) > 1 and all(p.dim() >= 3 and p.shape[2:] == parts[0].shape[2:] for p in parts):
        most = max(p.shape[1] for p in parts)
        parts = [torch.cat([p, p.new_zeros(p.shape[0], most - p.shape[1], *p.shape[2:])], 1) for p in parts]
    return torch.cat(parts)


# ---- teacher ------------------------------------------------------------------------------------------
@torch.no_grad()
def teacher(model, ids, mask, inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input embeddings with image features merged, final hidden states, logits), all [B, L, .]."""
    decoder = model.get_decoder()
    seen = {}

    def pre(module, args, kwargs):
        seen["embeds"] = kwargs.get("inputs_embeds")

    def post(module, args, output):
        seen["hidden"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    handles = [decoder.register_forward_pre_hook(pre, with_kwargs=True), decoder.register_forward_hook(post)]
    try:
        out = model(input_ids=ids, attention_mask=mask, **inputs)
    finally:
        for h in handles:
            h.remove()
    embeds = seen["embeds"] if seen.get("embeds") is not None else model.get_input_embeddings()(ids)
    return embeds, seen["hidden"], out.logits


# ---- losses -------------------------------------------------------------------------------------------
def soft_ce(student_logits, teacher_logits):
    """CE(p_teacher, p_student) minus the teacher's entropy, i.e. KL(p_teacher || p_student): the
    same gradient as the cross-entropy, and 0 when the drafter matches the target."""
    logp_t = F.log_softmax(teacher_logits.float(), -1)
    return (logp_t.exp() * (logp_t - F.log_softmax(student_logits.float(), -1))).sum(-1)


def head_loss(head, lm_head, ids, mask, embeds, hidden, logits, image_token, config: TrainDrafterConfig):
    """Feature + CE loss of an EAGLE / ViSpec / FLASH head (every slot), with `ttt_steps` unrolled forwards."""
    dtype = next(head.parameters()).dtype
    nxt = ids[:, 1:]
    pair_mask = mask[:, :-1] * mask[:, 1:]
    text = pair_mask.bool() if image_token is None else pair_mask.bool() & (nxt != image_token)
    h_in = hidden[:, :-1].to(dtype)
    e_in = embeds[:, 1:].to(dtype)
    total, parts = 0.0, []
    for _ in range(config.ttt_steps + 1):
        f, _, out_mask, src = head.forward_full(nxt, e_in, h_in, pair_mask)
        rows = torch.arange(ids.shape[0]).unsqueeze(1)
        valid = out_mask.bool() & text[rows, src]
        tgt_h = hidden[rows, src + 1].to(f.dtype)
        tgt_logits = logits[rows, src + 1]
        feat = F.smooth_l1_loss(f, tgt_h, reduction="none").mean(-1)
        ce = soft_ce(lm_head(f.to(lm_head.weight.dtype)), tgt_logits)
        loss = ((config.feature_weight * feat + config.ce_weight * ce) * valid).sum() / valid.sum().clamp_min(1)
        total = total + loss
        parts.append(float(loss.detach()))
        # Next unroll: the head reads its own predicted features where it made one (a FLASH
        # head's first slot: its outputs are laid out slot by slot, slot 0 first).
        n = f.shape[1] // getattr(head.config, "slots", 1)
        f, src, valid = f[:, :n], src[:, :n], valid[:, :n]
        pred = h_in.clone()
        ok = valid & (src + 1 < h_in.shape[1])
        pred[rows.expand_as(src)[ok], (src + 1)[ok]] = f[ok].to(pred.dtype)
        h_in = pred
    return total / (config.ttt_steps + 1), parts


def text_loss(lm, ids, mask, logits, image_token):
    student = lm(input_ids=ids, attention_mask=mask).logits[:, :-1]
    valid = (mask[:, :-1] * mask[:, 1:]).bool()
    if image_token is not None:
        valid &= ids[:, 1:] != image_token
    ce = soft_ce(student, logits[:, :-1])
    loss = (ce * valid).sum() / valid.sum().clamp_min(1)
    return loss, [float(loss.detach())]


# ---- the drafter being trained --------------------------------------------------------------------------
def check_text_drafter(target) -> None:
    """A text drafter is a small causal LM built from the target's text config; refuse a target
    whose text config transformers has no causal-LM class for (Qwen2-VL's), by name."""
    from transformers import AutoModelForCausalLM

    text = target.config.get_text_config()
    if type(text) not in AutoModelForCausalLM._model_mapping:
        raise ValueError(f"--drafter text builds a small causal LM from the target's text config, and transformers has "
                         f"no causal-LM class for {type(text).__name__} ({getattr(text, 'model_type', '?')}); train an "
                         "eagle or vispec drafter for this target")


def new_drafter(pipe, config: TrainDrafterConfig):
    from mmspec.drafters import EagleHeadConfig
    from mmspec.drafters.eagle_head import head_class

    target = pipe.target
    if config.drafter == "text":
        import copy

        from transformers import AutoModelForCausalLM

        text = copy.deepcopy(target.config.get_text_config())
        text.num_hidden_layers = config.text_layers
        if hasattr(text, "layer_types") and text.layer_types:
            text.layer_types = text.layer_types[: config.text_layers]
        text.tie_word_embeddings = False
        lm = AutoModelForCausalLM.from_config(text).float()
        with torch.no_grad():  # start from the target's embedding and LM head
            lm.get_input_embeddings().weight.copy_(target.get_input_embeddings().weight.float())
            lm.get_output_embeddings().weight.copy_(target.get_output_embeddings().weight.float())
        return lm
    shape = dict(slots=config.slots, compress_len=config.compress_len) if config.drafter == "flash" else {}
    return head_class(config.drafter)(EagleHeadConfig.for_target(target, kind=config.drafter, **shape)).float()


def component(drafter, config: TrainDrafterConfig):
    from mmspec.types import TreeConfig

    from .vlm_drafter import DrafterComponent

    tree = TreeConfig(config.tree_depth, config.tree_top_k, config.tree_num_nodes) if config.tree_depth else None
    K = None if tree else config.num_draft_tokens  # (a tree drafts its num_nodes; the config refuses K beside it)
    if config.drafter == "text":
        return DrafterComponent.from_lm(drafter, K, tree)
    return DrafterComponent.from_head(drafter, K, tree)


def step_loss(pipe, drafter, batch, config: TrainDrafterConfig):
    ids, mask, inputs = batch
    device = torch.device(config.device)
    ids, mask = ids.to(device), mask.to(device)
    inputs = {k: (v.to(device, pipe.target.dtype) if torch.is_floating_point(v) else v.to(device))
              for k, v in inputs.items()}
    embeds, hidden, logits = teacher(pipe.target, ids, mask, inputs)
    image_token = getattr(pipe.target.config, "image_token_id", getattr(pipe.target.config, "image_token_index", None))
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=config.bf16):
        if config.drafter == "text":
            return text_loss(drafter, ids, mask, logits, image_token)
        return head_loss(drafter, pipe.target.get_output_embeddings(), ids, mask, embeds, hidden, logits,
                         image_token, config)


# ---- the loop -------------------------------------------------------------------------------------------
def train_drafter(config: TrainDrafterConfig, pipe=None) -> dict:
    """Train (or resume) and save the drafter; returns {"losses": [...], "out": dir}. Seeds torch's
    global RNG with `config.seed` first (the head's initialisation and the data order depend on
    it), so the caller's own random stream is not where it was after this returns. A `pipe`
    given by the caller has its target moved to `config.device` (it stays there); the target's
    `requires_grad` flags and train / eval mode, which training sets for the teacher, are put
    back as they were."""
    if pipe is None:
        return _train_drafter(config, load_target_pipeline(config.pipeline))
    target = pipe.target
    flags = [(p, p.requires_grad) for p in target.parameters()]
    modes = [(m, m.training) for m in target.modules()]
    try:
        return _train_drafter(config, pipe)
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
        for m, mode in modes:  # per module: a model may keep some parts in eval mode on purpose
            m.training = mode


def _train_drafter(config: TrainDrafterConfig, pipe) -> dict:
    from tqdm import tqdm

    torch.manual_seed(config.seed)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    pipe.target.to(config.device).requires_grad_(False).eval()  # the teacher runs without dropout
    if config.drafter == "text":
        check_text_drafter(pipe.target)  # before minutes of regenerated answers
    identity = target_identity(pipe.target)
    data_path = out / "data.pt"
    size = world_image_size(pipe)
    key = data_key(config, size, identity)
    ckpt_path, log_path = out / "checkpoint.pt", out / "train_log.jsonl"
    ckpt = torch.load(ckpt_path, weights_only=False) if ckpt_path.is_file() else None
    if ckpt is not None and ckpt.get("data_key") != key:  # checked before minutes of regenerated answers
        raise ValueError(key_mismatch(ckpt_path, "was trained on the answers of another run", ckpt.get("data_key"), key))
    if data_path.is_file():
        examples = load_data(data_path, config, size, identity)
    else:
        examples = regenerate(pipe, data_items(config, size), config)
        torch.save({"key": key, "examples": examples}, data_path)
    drafter = new_drafter(pipe, config).to(config.device).train()
    params = [p for p in drafter.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    start, rng = 0, random.Random(config.seed)
    if ckpt is not None:
        if ckpt["config"]["drafter"] != config.drafter:
            raise ValueError(f"{ckpt_path} holds a {ckpt['config']['drafter']!r} drafter, not {config.drafter!r}; "
                             "use another --out")
        # a cosine run is defined by its whole schedule; a constant one may go on longer or slower
        # (checkpoints written before the schedule existed ran the constant default)
        saved = {**asdict(TrainDrafterConfig(pipeline="-", drafter=config.drafter, out="-")), **ckpt["config"]}
        schedule = ("lr_schedule",) + (("lr", "warmup_steps", "steps") if config.lr_schedule == "cosine" else ())
        changed = {k: saved[k] for k in schedule if saved[k] != getattr(config, k)}
        changed.update({k: saved[k] for k in RUN_FIELDS if saved[k] != getattr(config, k)})
        if changed:  # a resumed run must follow the schedule and the steps of the run it continues
            raise ValueError(f"{ckpt_path} was trained with {changed} (this run: "
                             f"{ {k: getattr(config, k) for k in changed} }); resume with those settings or use another --out")
        drafter.load_state_dict(ckpt["model"])
        optim.load_state_dict(ckpt["optim"])
        start = ckpt["step"]
        rng.setstate(ckpt["rng"])
        torch.set_rng_state(ckpt["torch_rng"])
    pad = pipe.processor.tokenizer.pad_token_id or 0
    losses = []
    bar = tqdm(range(start, config.steps), desc=f"train {config.drafter} drafter", disable=not config.progress,
               initial=start, total=config.steps)
    for step in bar:
        optim.zero_grad(set_to_none=True)
        for group in optim.param_groups:
            group["lr"] = lr_at(config, step)
        parts_sum = None
        for _ in range(config.grad_accum):
            batch = collate(rng.sample(examples, min(config.batch_size, len(examples))), pad)
            loss, parts = step_loss(pipe, drafter, batch, config)
            (loss / config.grad_accum).backward()
            parts_sum = parts if parts_sum is None else [a + b for a, b in zip(parts_sum, parts)]
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        parts_mean = [p / config.grad_accum for p in parts_sum]
        losses.append(parts_mean[0])
        bar.set_postfix(loss=f"{parts_mean[0]:.4f}")
        with log_path.open("a") as f:
            f.write(json.dumps({"step": step + 1, "loss": parts_mean[0], "unrolled": parts_mean[1:]}) + "\n")
        if (step + 1) % config.save_every == 0 or step + 1 == config.steps:
            torch.save({"step": step + 1, "model": drafter.state_dict(), "optim": optim.state_dict(),
                        "rng": rng.getstate(), "torch_rng": torch.get_rng_state(), "config": asdict(config),
                        "data_key": key},
                       ckpt_path)
    drafter.eval()
    component(drafter.cpu(), config).save_pretrained(str(out))
    return {"losses": losses, "out": str(out)}
