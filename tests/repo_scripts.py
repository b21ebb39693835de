"""Import modules of bench/ and tools/: directories of scripts that import their siblings by name,
not packages. Their directory is on sys.path for the import only, so no other test sees it."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def import_script(directory: str, *names: str) -> list:
    path = str(REPO / directory)
    sys.path.insert(0, path)
    try:
        return [importlib.import_module(n) for n in names]
    finally:
        sys.path.remove(path)
