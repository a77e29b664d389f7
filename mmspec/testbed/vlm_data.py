"""Stage ``data`` of ``mmspec testbed train-vlm`` (the driver is ``mmspec.testbed.vlm_train``):
the world's scenes rendered once and saved with everything the later stages read.

What: for each of ``n_train`` training and ``n_val`` validation scenes, the processor's pixel
values (fp16), the tower's labels (``vlm_tower.scene_labels``: per-patch class, per-object
coverage and class, the present classes, the object count), the captions (the world's own, or
the same grammar with the objects in a fixed order, ``caption_order``) and the Q/A pairs; the
processor is saved beside them (``work/processor``).

Why: rendering the default 108000 scenes takes about 3 minutes on 2 cores (2.6 GB of fp16
pixels; one process per ``--threads``, each scene from its own index's random stream, so the
data do not depend on the number of processes); the tower, LM, tune and drafter stages all read
the same tensors, so reruns of a later stage start from them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mmspec.testbed.vlm_tower import scene_labels


def _render_range(cfg, split: str, start: int, stop: int, processor, pixels: torch.Tensor) -> dict:
    """Scenes ``start:stop`` of ``split``: their pixels written into ``pixels[start:stop]``, the rest returned."""
    from mmspec.testbed.language import sample_captions
    from mmspec.testbed.world import World

    world = World(seed=cfg.seed, split=split, image_size=cfg.image_size)  # rendered at the processor crop: no resampling
    wc = world.config
    out = {k: [] for k in ("patches", "cover", "objects", "present", "count", "captions", "qa")}
    chunk, chunk_start = [], start
    for i in range(start, stop):
        s = world.scene(i)
        chunk.append(s.image)
        pl, cv, ob = scene_labels(s.attributes, cfg.image_size, cfg.patch_size, wc)
        out["patches"].append(pl)
        out["cover"].append(cv)
        out["objects"].append(ob)
        pres = np.zeros(wc.num_classes, dtype=np.float32)
        for o in s.attributes["objects"]:
            pres[wc.class_label(o["shape"], o["colour"])] = 1
        out["present"].append(pres)
        out["count"].append(len(s.attributes["objects"]) - 1)
        if cfg.caption_order == "random":  # the world's own captions
            out["captions"].append(s.captions)
        else:  # the same grammar, objects named in a fixed order (own stream: the scene is unchanged)
            rng = np.random.default_rng([cfg.seed, 7, i, split == "train"])
            out["captions"].append(sample_captions(s.attributes, len(s.captions), rng, cfg.caption_order))
        out["qa"].append(s.qa)
        if len(chunk) == 256 or i == stop - 1:
            pixels[chunk_start:i + 1] = processor.image_processor(chunk, return_tensors="pt")["pixel_values"].half()
            chunk, chunk_start = [], i + 1
    return out


_WORKER: dict = {}


def _worker_range(bounds: tuple[int, int]) -> tuple[int, dict]:
    torch.set_num_threads(1)
    w = _WORKER
    return bounds[0], _render_range(w["cfg"], w["split"], bounds[0], bounds[1], w["processor"], w["pixels"])


def render(cfg, split: str, n: int, processor, workers: int | None = None) -> dict:
    """The ``n`` first scenes of ``split`` (module docstring), rendered by ``workers`` processes
    (default ``cfg.threads``): every scene draws from its own index's random stream, so the result
    does not depend on the number of workers. The pixels go straight into one preallocated tensor
    (shared with the workers), not a list concatenated at the end: half the peak memory."""
    import mmap
    import multiprocessing

    from tqdm import tqdm

    workers = max(1, cfg.threads if workers is None else workers)
    side = cfg.image_size
    step = 1024
    ranges = [(a, min(a + step, n)) for a in range(0, n, step)]
    parts: dict[int, dict] = {}
    bar = tqdm(total=n, desc=f"render {split}", disable=not cfg.progress)
    if workers > 1 and len(ranges) > 1 and "fork" in multiprocessing.get_all_start_methods():
        # an anonymous shared mapping, inherited by the forked workers (no /dev/shm needed)
        numel = n * 3 * side * side
        pixels = torch.frombuffer(mmap.mmap(-1, numel * 2), dtype=torch.float16, count=numel).view(n, 3, side, side)
        _WORKER.update(cfg=cfg, split=split, processor=processor, pixels=pixels)
        try:
            with multiprocessing.get_context("fork").Pool(min(workers, len(ranges))) as pool:
                for start, part in pool.imap_unordered(_worker_range, ranges):
                    parts[start] = part
                    bar.update(len(part["count"]))
        finally:
            _WORKER.clear()
    else:
        pixels = torch.empty(n, 3, side, side, dtype=torch.float16)
        for a, b in ranges:
            parts[a] = _render_range(cfg, split, a, b, processor, pixels)
            bar.update(b - a)
    bar.close()
    cat = {k: [x for a in sorted(parts) for x in parts[a][k]] for k in parts[0]} if parts else {}
    return {"pixels": pixels, "patches": torch.from_numpy(np.stack(cat["patches"])),
            "cover": torch.from_numpy(np.stack(cat["cover"])).half(), "objects": torch.from_numpy(np.stack(cat["objects"])),
            "present": torch.from_numpy(np.stack(cat["present"])), "count": torch.tensor(cat["count"]),
            "captions": cat["captions"], "qa": cat["qa"]}


def stage_data(cfg, work: Path) -> dict:
    from mmspec.testbed.vlm_train import build_processor

    processor = build_processor(cfg)
    processor.save_pretrained(work / "processor")
    for split, n in (("train", cfg.n_train), ("validation", cfg.n_val)):
        torch.save(render(cfg, split, n, processor), work / f"data_{split}.pt")
    return {"n_train": cfg.n_train, "n_val": cfg.n_val, "visual_tokens": cfg.num_visual_tokens,
            "vocab_size": len(processor.tokenizer)}
