"""`ASSETS`: the folder of the bundled testbed models and images.

A wheel ships them inside the package (`mmspec/assets`); a source checkout or an editable
install keeps them beside it (`<repository>/assets`). Every default that names a bundled
folder is built from this one path, so it holds from any working directory and either layout."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent
ASSETS = next((p for p in (_HERE / "assets", _HERE.parent / "assets") if (p / "testbed").is_dir()), _HERE.parent / "assets")
