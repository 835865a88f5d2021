"""The top-level folders import one another in one direction only (imports inside functions
count too): core ← backends ← entrypoints ← {benchmarks, conformance}, fixtures beside core;
the `pagedllm` command (cli.py) and the package's own names (__init__.py) sit above them all:
`from pagedllm import X` counts as an import of the folder X comes from, and of the package
itself where X is defined there. Inside core/, the vocabulary every process shares (its top
modules) imports neither the scheduling brain (core/scheduling/) nor the process plumbing
(core/process/), and the brain does not import the plumbing."""

from __future__ import annotations

import ast
import importlib
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


def imported_modules(path: Path) -> list[str]:
    """The dotted names a file imports, absolute (`from pagedllm import X`: X's own module)."""
    names = []
    package = ".".join(("pagedllm", *path.relative_to(CHECKOUT).parent.parts))
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
                names += [module] if node.module else [f"{module}.{a.name}" for a in node.names]
            elif node.module == "pagedllm":
                names += [where_defined(a.name) for a in node.names]
            elif node.module:
                names.append(node.module)
    return names


def where_defined(name: str) -> str:
    """The module that `pagedllm.<name>` comes from; "pagedllm" where the package defines it."""
    value = getattr(importlib.import_module("pagedllm"), name)
    module = getattr(value, "__module__", None) if not isinstance(value, str) else None
    return module if module and module.startswith("pagedllm.") else "pagedllm"


def imported_folders(path: Path, folder: str) -> set[str]:
    found = set()
    for name in imported_modules(path):
        parts = name.split(".")
        if parts[0] != "pagedllm":
            continue
        if len(parts) == 1:
            found.add("the pagedllm package itself")
        elif parts[1] in FOLDERS and parts[1] != folder:
            found.add(parts[1])
    return found


def test_no_folder_imports_against_the_layering():
    wrong = []
    for folder in FOLDERS:
        for path in (CHECKOUT / folder).rglob("*.py"):
            for other in imported_folders(path, folder) - ALLOWED[folder]:
                wrong.append(f"{path.relative_to(CHECKOUT)} imports {other}")
    assert not wrong, "\n".join(sorted(wrong))


def test_imports_from_the_package_itself_are_seen():
    """The check above sees `from pagedllm import X` (the way an upward import hid before)."""
    assert imported_folders(CHECKOUT / "benchmarks" / "bench_speculative.py", "benchmarks") >= {"entrypoints", "core"}
    assert where_defined("__version__") == "pagedllm"


CORE_PARTS = {"vocabulary": set(), "scheduling": {"vocabulary"}, "process": {"vocabulary", "scheduling"}}


def core_part(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["pagedllm", "core"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in ("scheduling", "process") else "vocabulary"


def test_core_parts_import_in_one_direction():
    wrong = []
    for path in (CHECKOUT / "core").rglob("*.py"):
        mine = core_part("pagedllm." + ".".join(path.relative_to(CHECKOUT).with_suffix("").parts))
        for module in imported_modules(path):
            theirs = core_part(module)
            if theirs and theirs != mine and theirs not in CORE_PARTS[mine]:
                wrong.append(f"{path.relative_to(CHECKOUT)} ({mine}) imports {module} ({theirs})")
    assert not wrong, "\n".join(sorted(wrong))
