"""Every `mmspec` command and subcommand prints its --help (argparse formats help strings with
%-formatting, so a bare '%' in one crashes the help of its parent: `mmspec testbed --help` did)."""

from __future__ import annotations

import argparse

import pytest

from mmspec.cli import SUITES, build_parser, main


def parsers(parser: argparse.ArgumentParser, path=("mmspec",)):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, path + (name,))


def test_every_command_formats_its_help():
    found = list(parsers(build_parser()))
    names = {" ".join(p) for p, _ in found}
    assert {"mmspec testbed", "mmspec testbed eval-vlm", "mmspec demo", "mmspec generate", "mmspec bench"} <= names
    for path, parser in found:
        text = parser.format_help()  # raises on a bad help string of the parser or of a subcommand
        assert text.startswith("usage: " + " ".join(path)), path


def test_building_the_parsers_loads_no_model_library():
    # `mmspec --help` took ~4 s while the train-imagegen parser built a config (importing diffusers)
    import subprocess
    import sys

    code = ("import sys; from mmspec.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('diffusers', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("suite", sorted(SUITES))
def test_every_bench_suite_prints_its_help(suite, capsys):
    # `mmspec bench SUITE` parses its own options (mmspec/bench/__init__.py)
    with pytest.raises(SystemExit) as done:
        main(["bench", suite, "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")


def test_bad_values_and_wrong_folders_end_in_a_message_not_a_traceback(tmp_path, monkeypatch):
    """A ValueError naming the problem, or the OS's error naming a path, ended the command with a
    traceback (generate on a VLM folder, --target-layers 0, --out naming a file, ...)."""
    from pathlib import Path

    vlm = Path(__file__).resolve().parents[1] / "assets" / "testbed" / "vlm"
    afile = tmp_path / "a_file"
    afile.write_text("x")
    for argv, message in [(["generate", "--model", str(vlm), "--class", "1", "--out", str(tmp_path / "o")],
                           r"mmspec generate: .* holds a SpeculativeVLMPipeline pipeline"),
                          (["bench", "--smoke", "--target-layers", "0"], r"mmspec bench: target_layers must be >= 2"),
                          (["generate", "--class", "1", "--out", str(afile)],
                           r"mmspec generate: .*a_file is a file, not a folder; give the path of a folder"),
                          (["testbed", "compare-vlm", str(vlm), str(vlm), "--scenes", "0"],
                           r"mmspec testbed compare-vlm: scenes must be an int >= 1")]:
        with pytest.raises(SystemExit, match=message):
            main(argv)
    monkeypatch.setenv("MMSPEC_TRACEBACK", "1")  # for bug reports: the exception itself
    with pytest.raises(ValueError, match="target_layers must be >= 2"):
        main(["bench", "--smoke", "--target-layers", "0"])


def test_sizes_given_beside_smoke_are_refused_not_replaced():
    """--smoke ran its own tiny sizes and silently replaced --batch-sizes, --images, --pairs, ..."""
    for argv, flags in [(["bench", "--smoke", "--batch-sizes", "4", "--max-new-tokens", "32"], "--batch-sizes, --max-new-tokens"),
                        (["bench", "imagegen", "--smoke", "--judge-images", "8"], "--judge-images"),
                        (["bench", "core", "--smoke", "--fixed-k", "3"], "--fixed-k")]:
        with pytest.raises(SystemExit, match=f"--smoke runs its own tiny sizes and would replace {flags}"):
            main(argv)
