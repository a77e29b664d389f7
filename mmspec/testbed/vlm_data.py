"""Stage ``data`` of ``mmspec testbed train-vlm`` (the driver is ``mmspec.testbed.vlm_train``):
the world's scenes rendered once and saved with everything the later stages read.

What: for each of ``n_train`` training and ``n_val`` validation scenes, the processor's pixel
values (fp16), the tower's labels (``vlm_tower.scene_labels``: per-patch class, per-object
coverage and class, the present classes, the object count), the captions (the world's own, or
the same grammar with the objects in a fixed order, ``caption_order``) and the Q/A pairs; the
processor is saved beside them (``work/processor``).

Why: rendering the default 108000 scenes takes about 3 minutes on 2 cores (2.6 GB of fp16
pixels); the tower, LM, tune and drafter stages all read the same tensors, so reruns of a
later stage start from them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mmspec.testbed.vlm_tower import scene_labels


def render(cfg, split: str, n: int, processor) -> dict:
    from tqdm import tqdm

    from mmspec.testbed.language import sample_captions
    from mmspec.testbed.world import World

    world = World(seed=cfg.seed, split=split, image_size=cfg.image_size)  # rendered at the processor crop: no resampling
    wc = world.config
    pixels, patches, cover, objects, present, count, captions, qa = [], [], [], [], [], [], [], []
    chunk = []
    for i in tqdm(range(n), desc=f"render {split}", disable=not cfg.progress):
        s = world.scene(i)
        chunk.append(s.image)
        pl, cv, ob = scene_labels(s.attributes, cfg.image_size, cfg.patch_size, wc)
        patches.append(pl)
        cover.append(cv)
        objects.append(ob)
        pres = np.zeros(wc.num_classes, dtype=np.float32)
        for o in s.attributes["objects"]:
            pres[wc.class_label(o["shape"], o["colour"])] = 1
        present.append(pres)
        count.append(len(s.attributes["objects"]) - 1)
        if cfg.caption_order == "random":  # the world's own captions
            captions.append(s.captions)
        else:  # the same grammar, objects named in a fixed order (own stream: the scene is unchanged)
            rng = np.random.default_rng([cfg.seed, 7, i, split == "train"])
            captions.append(sample_captions(s.attributes, len(s.captions), rng, cfg.caption_order))
        qa.append(s.qa)
        if len(chunk) == 256 or i == n - 1:
            pixels.append(processor.image_processor(chunk, return_tensors="pt")["pixel_values"].half())
            chunk = []
    return {"pixels": torch.cat(pixels), "patches": torch.from_numpy(np.stack(patches)),
            "cover": torch.from_numpy(np.stack(cover)).half(), "objects": torch.from_numpy(np.stack(objects)),
            "present": torch.from_numpy(np.stack(present)), "count": torch.tensor(count),
            "captions": captions, "qa": qa}


def stage_data(cfg, work: Path) -> dict:
    from mmspec.testbed.vlm_train import build_processor

    processor = build_processor(cfg)
    processor.save_pretrained(work / "processor")
    for split, n in (("train", cfg.n_train), ("validation", cfg.n_val)):
        torch.save(render(cfg, split, n, processor), work / f"data_{split}.pt")
    return {"n_train": cfg.n_train, "n_val": cfg.n_val, "visual_tokens": cfg.num_visual_tokens,
            "vocab_size": len(processor.tokenizer)}
