"""Stage ``tune`` of ``mmspec testbed train-vlm``: a second, short pass over the training scenes
that shows the LM more look-up questions ("is there a violet disc ?").

What: starting from the ``lm`` stage's model (``OUT_work/pipeline_lm``, or ``--tune-from`` a
saved pipeline, e.g. a bundle), ``tune_steps`` more teacher-forced steps on the same data and
loss as the LM stage (tower frozen unless asked below), learning rate ``tune_lr`` decaying to 0 on a cosine, with
a different mix: captions as often as before (``caption_fraction``), and of the Q/A examples a
share ``tune_exists_fraction`` drawn from the scene's existence questions (the rest from all
its questions, as before); rows packed as in the LM stage when ``lm_pack`` > 1, and the tower's last
``tune_tower_layers`` layers trained (learning rate x ``lm_tower_lr_scale``; 0, the default, keeps it
frozen). The tuned pipeline replaces ``OUT_work/pipeline``, which the drafter
and eval stages read; ``tune_steps = 0`` skips the stage (the LM stage's model stays).

Why (session 17's measurements on the session-14 bundle, 200 validation scenes): its LM
answered "yes" to every existence question, on training scenes too (355 of 355 validation
questions, accuracy 52%): with them one question in six, 5000 steps never got it off the
plateau where the answer ignores the image. Existence needs the LM to look an object up by a
colour and a shape named in the question (synonyms included), not to describe the object it is
at. Tuning the bundle for 2000 steps with half the Q/A examples existence questions (a first,
uncommitted script): existence 84.5% of 355, VQA on the first questions 77.5% (65.0% before),
captions 74.5% (72.5%); this stage, with its own sample order, gave VQA 73.5% (existence
60/66 first questions) and captions 73.0%, the bundled model. The same mix on 4000 scenes
overfitted (captions 69%): the stage uses the full training set.

Limits: the mix is tuned to the default world's grammar (``language.Q_EXISTS``); another
grammar needs its own look-up templates in ``vlm_eval.question_kind``.
"""

from __future__ import annotations

import math
import random
import shutil
from pathlib import Path

import torch


def stage_tune(cfg, work: Path, log: dict) -> dict:
    from tqdm import tqdm

    from mmspec.pipelines.vlm import SpeculativeVLMPipeline
    from mmspec.testbed.vlm_train import (CAPTION_PROMPT, cache_states, lm_optimiser, lm_update, sample_examples,
                                          shape_word_ids)
    from mmspec.testbed.vlm_pack import sample_packs

    source, lm_dir = Path(cfg.tune_from) if cfg.tune_from else work / "pipeline_lm", work / "pipeline_lm"
    if not cfg.tune_from and not lm_dir.is_dir():
        if not (work / "pipeline").is_dir():
            raise FileNotFoundError(f"stage tune: no LM stage output under {work} (run --stages lm first, "
                                    "or pass --tune-from a saved pipeline)")
        shutil.move(str(work / "pipeline"), str(lm_dir))  # keep the LM stage's model: reruns start from it
    if not (source / "model_index.json").is_file():
        raise FileNotFoundError(f"stage tune: {source} is not a saved pipeline (no model_index.json)")
    if cfg.tune_steps == 0:
        if (work / "pipeline").exists():
            shutil.rmtree(work / "pipeline")
        shutil.copytree(source, work / "pipeline")
        (work / "drafter_data.pt").unlink(missing_ok=True)  # answers of the target replaced here
        return {"steps": 0, "source": str(source)}
    loaded = SpeculativeVLMPipeline.from_pretrained(source, dtype=torch.float32)
    model, processor = loaded.target.to(cfg.device), loaded.processor
    tok = processor.tokenizer
    image_id = tok.convert_tokens_to_ids(processor.image_token)
    train = torch.load(work / "data_train.pt", weights_only=False, mmap=True)  # pixels read from disk as used
    model.model.vision_tower.requires_grad_(False).eval()
    n_top = cfg.tune_tower_layers  # the tower below them stays frozen, its output cached
    states = cache_states(model, train["pixels"], cfg.device, n_top)
    del train["pixels"]
    optim, params = lm_optimiser(model, n_top, cfg.tune_lr, cfg.lm_tower_lr_scale)
    weight_ids = torch.tensor(shape_word_ids(tok), device=cfg.device)
    rng = random.Random(cfg.seed + 3)
    model.train()
    model.model.vision_tower.eval()
    log["tune"] = []
    pool: list = []
    bar = tqdm(range(cfg.tune_steps), desc="tune", disable=not cfg.progress)
    for step in bar:
        if len(pool) < cfg.lm_batch:
            if cfg.lm_pack > 1:  # rows of lm_pack examples sharing one image, as in the LM stage
                epoch = sample_packs(train, tok, rng, cfg.caption_fraction, cfg.tune_exists_fraction, cfg.lm_pack,
                                     CAPTION_PROMPT)
            else:
                epoch = sample_examples(train, tok, rng, cfg.caption_fraction, cfg.tune_exists_fraction)  # the tune mix
            rng.shuffle(epoch)
            pool += epoch
        batch, pool = pool[:cfg.lm_batch], pool[cfg.lm_batch:]
        for g in optim.param_groups:
            g["lr"] = cfg.tune_lr * 0.5 * (1 + math.cos(math.pi * step / cfg.tune_steps)) * g["scale"]
        loss, plain = lm_update(model, optim, params, batch, states, tok, image_id, cfg, n_top, weight_ids)
        bar.set_postfix(loss=f"{float(plain.detach()):.3f}")
        if step % 25 == 0 or step == cfg.tune_steps - 1:
            log["tune"].append({"step": step, "loss": float(plain.detach()), "weighted_loss": float(loss.detach())})
    model.eval().cpu()
    pipe = SpeculativeVLMPipeline(model, processor, caption_prompt=CAPTION_PROMPT)
    if (work / "pipeline").exists():
        shutil.rmtree(work / "pipeline")
    pipe.save_pretrained(work / "pipeline")
    (work / "drafter_data.pt").unlink(missing_ok=True)  # the untuned target's answers: the drafters regenerate them
    return {"steps": cfg.tune_steps, "source": str(source), "first_loss": log["tune"][0]["loss"],
            "final_train_loss": log["tune"][-1]["loss"]}
