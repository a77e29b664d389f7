"""Bundled folders carry no path of the machine that trained them.

diffusers and transformers record where a model was loaded from (`_name_or_path`) and write it
into every config.json that `save_pretrained` makes; the testbed commands load their stages
from a work folder, so the shipped configs named folders such as /work/s37/work/drafter_eagle.
Loading ignores the key; it only leaked the trainer's file system into the package.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def drop_machine_paths(folder) -> list[str]:
    """Remove an absolute-path `_name_or_path` from every config.json under `folder` (written
    back in the libraries' own format: 2-space indent, sorted keys). Returns the files changed."""
    changed = []
    for path in sorted(Path(folder).rglob("config.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and os.path.isabs(str(data.get("_name_or_path", ""))):
            del data["_name_or_path"]
            path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
            changed.append(str(path))
    return changed
