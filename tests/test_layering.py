"""The layering and layout rules of docs/architecture.md, read from the source files' imports."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STDLIB = set(sys.stdlib_module_names) | {"__future__"}
CORE_FILES = sorted((ROOT / "mmspec").glob("*.py"))  # the core proper; adapters live in subfolders
CORE_OK = STDLIB | {"torch", "numpy", "mmspec"}
HEAVY = {"transformers", "diffusers", "PIL", "tokenizers", "safetensors", "torchvision"}


def module_level_imports(path: Path) -> list[str]:
    """Top-level module names imported at import time (not inside functions)."""
    tree = ast.parse(path.read_text())
    names = []
    for node in tree.body:
        nodes = [node]
        if isinstance(node, (ast.If, ast.Try)):
            nodes = list(ast.walk(node))
        for n in nodes:
            if isinstance(n, ast.Import):
                names += [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom) and n.level == 0:
                names.append(n.module)
    return names


def test_layout_exists():
    for name in ["pyproject.toml", "README.md", "mmspec", "pipelines", "drafters", "acceptance", "tests", "assets",
                 "benchmarks", ".ci/run", "docs/architecture.md", "docs/algorithms.md"]:
        assert (ROOT / name).exists(), name


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: p.name)
def test_core_imports_only_torch_numpy_stdlib(path):
    bad = [m for m in module_level_imports(path) if m.split(".")[0] not in CORE_OK]
    assert not bad, f"{path.name} imports {bad} at module level"
    inner = [m for m in module_level_imports(path) if m.startswith("mmspec.")]
    sub = [m for m in inner if m.split(".")[1] in {"models", "testbed", "acceptance", "drafters", "pipelines"}]
    assert not sub, f"{path.name} imports {sub} at module level; import adapters/rules lazily"


@pytest.mark.parametrize("path", sorted((ROOT / "acceptance").glob("*.py")), ids=lambda p: p.name)
def test_acceptance_imports_only_torch_and_core(path):
    for m in module_level_imports(path):
        top = m.split(".")[0]
        assert top in STDLIB | {"torch", "mmspec"}, f"{path.name} imports {m}"
        if top == "mmspec":
            assert m in {"mmspec.types", "mmspec.sampling", "mmspec.tree", "mmspec.protocols", "mmspec.stats"}, m
        assert top != "acceptance", "use relative imports; nobody imports a bare `acceptance`"


@pytest.mark.parametrize("path", sorted((ROOT / "drafters").glob("*.py")), ids=lambda p: p.name)
def test_drafters_do_not_import_pipelines(path):
    for m in module_level_imports(path):
        assert not m.startswith("mmspec.pipelines") and m.split(".")[0] not in {"drafters", "pipelines", "diffusers"}, m


def test_importing_mmspec_stays_light():
    import subprocess

    code = "import sys, mmspec, mmspec.acceptance; print(sorted(m for m in {'transformers','diffusers','PIL'} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_no_package_file_over_600_lines():
    files = [p for d in ["mmspec", "acceptance", "drafters", "pipelines"] for p in (ROOT / d).rglob("*.py")]
    long = [(str(p.relative_to(ROOT)), n) for p in files if (n := len(p.read_text().splitlines())) > 600]
    assert not long


def test_package_cites_only_what_the_repository_carries():
    """Design notes outside the repository are not cited; docs/ carries our own."""
    files = [p for d in ["mmspec", "acceptance", "drafters", "pipelines", "benchmarks"] for p in (ROOT / d).rglob("*.py")]
    files += [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    bad = [str(p.relative_to(ROOT)) for p in files if any(s in p.read_text() for s in ("DESIGN.md", "ALGORITHMS.md", "../shared"))]
    assert not bad
