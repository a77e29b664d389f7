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


@pytest.mark.parametrize("suite", sorted(SUITES))
def test_every_bench_suite_prints_its_help(suite, capsys):
    # `mmspec bench SUITE` parses its own options (mmspec/bench/__init__.py)
    with pytest.raises(SystemExit) as done:
        main(["bench", suite, "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")
