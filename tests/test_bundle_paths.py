"""Bundled testbed folders carry no path of the machine that trained them (mmspec/testbed/bundle_paths.py)."""

from __future__ import annotations

import json
from pathlib import Path

from mmspec.testbed.bundle_paths import drop_machine_paths

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "testbed"


def test_shipped_configs_name_no_machine_path():
    configs = sorted(ASSETS.rglob("config.json"))
    assert len(configs) >= 10  # the image generator, VQ, judge, MAR and VLM folders
    for path in configs:
        value = json.loads(path.read_text()).get("_name_or_path", "")
        assert not str(value).startswith("/"), (path, value)


def test_drop_machine_paths_after_a_reload(tmp_path):
    from mmspec.models.mar import MARModel

    from test_mar_cspd import TINY

    MARModel(**TINY).save_pretrained(tmp_path / "work")
    MARModel.from_pretrained(tmp_path / "work").save_pretrained(tmp_path / "out" / "transformer")  # as train-mar does
    cfg = tmp_path / "out" / "transformer" / "config.json"
    assert json.loads(cfg.read_text())["_name_or_path"] == str(tmp_path / "work")  # what the libraries write
    before = cfg.read_text()
    assert drop_machine_paths(tmp_path / "out") == [str(cfg)]
    after = cfg.read_text()
    assert "_name_or_path" not in json.loads(after)
    assert [line for line in before.splitlines() if "_name_or_path" not in line] == after.splitlines()  # nothing else moved
    assert drop_machine_paths(tmp_path / "out") == []
    MARModel.from_pretrained(tmp_path / "out" / "transformer")  # still loads
