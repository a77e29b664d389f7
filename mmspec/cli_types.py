"""argparse value types shared by mmspec's commands."""

from __future__ import annotations

import argparse


def window_arg(text: str) -> int | str:
    """A Jacobi window (or a tree's node count): "auto" (chosen by measurement) or an int >= 1."""
    return "auto" if text == "auto" else positive_int(text)


def positive_int(text: str) -> int:
    """An int >= 1 (e.g. --threads: torch would fail later with "set_num_threads expects a positive
    integer", and 0 read as "not given" would silently keep torch's default)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value}")
    return value


def image_file_names(labels: list[int]) -> list[str]:
    """PNG names for images of class `labels` in order: class{c:02d}_{n}.png, n counting the images
    of class c so far (a class given twice, `--class 3 3`, wrote both images to one file)."""
    seen: dict[int, int] = {}
    names = []
    for c in labels:
        names.append(f"class{c:02d}_{seen.get(c, 0)}.png")
        seen[c] = seen.get(c, 0) + 1
    return names


def given_flags(args, defaults, names: tuple[str, ...]) -> list[str]:
    """The options among `names` whose value differs from the parser's `defaults`, as flags
    (`batch_sizes` -> `--batch-sizes`): what a user gave that a command would otherwise ignore."""
    return ["--" + n.replace("_", "-") for n in names if getattr(args, n, None) != getattr(defaults, n, None)]


def refuse_beside_smoke(command: str, args, defaults, names: tuple[str, ...]) -> None:
    """`--smoke` runs its own tiny sizes: options among `names` given beside it would be replaced
    silently, so they are refused by flag."""
    given = given_flags(args, defaults, names)
    if given:
        raise SystemExit(f"mmspec {command}: --smoke runs its own tiny sizes and would replace {', '.join(given)}; "
                         f"drop {'it' if len(given) == 1 else 'them'} or --smoke")
