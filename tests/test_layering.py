"""The top-level folders import one another in one direction only (imports inside functions
count too): core ← backends ← entrypoints ← {benchmarks, conformance}, fixtures beside core;
the `pagedllm` command (cli.py) sits above them all."""

from __future__ import annotations

import ast
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
FOLDERS = ("core", "backends", "entrypoints", "conformance", "benchmarks", "fixtures")
ALLOWED = {
    "core": set(),
    "fixtures": {"core"},
    "backends": {"core"},
    "entrypoints": {"core", "backends", "fixtures"},
    "conformance": {"core", "backends", "entrypoints", "fixtures"},
    "benchmarks": {"core", "backends", "entrypoints", "fixtures", "conformance"},
}


def imported_folders(path: Path, folder: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level >= 2:  # from ..X import: a sibling folder
                names = [f"pagedllm.{node.module}" if node.module else ""]
            elif node.level == 0 and node.module:
                names = [node.module]
        for name in names:
            parts = name.split(".")
            if len(parts) > 1 and parts[0] == "pagedllm" and parts[1] in FOLDERS and parts[1] != folder:
                found.add(parts[1])
    return found


def test_no_folder_imports_against_the_layering():
    wrong = []
    for folder in FOLDERS:
        for path in (CHECKOUT / folder).rglob("*.py"):
            for other in imported_folders(path, folder) - ALLOWED[folder]:
                wrong.append(f"{path.relative_to(CHECKOUT)} imports pagedllm.{other}")
    assert not wrong, "\n".join(sorted(wrong))
