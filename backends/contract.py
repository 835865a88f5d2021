"""The public surface of the backend contract — every member of Platform and AttentionOps a
port may override or read, with its signature or default — as one JSON document. A test keeps
a copy of it (tests/backend_contract.json) and fails when the surface changes without a new
CONTRACT_VERSION; docs/porting.md says what each version changed for ports.

    python -m pagedllm.backends.contract > tests/backend_contract.json
"""

from __future__ import annotations

import inspect
import json


def _describe(value) -> str:
    if isinstance(value, staticmethod):
        return f"staticmethod{inspect.signature(value.__func__)}"
    if isinstance(value, property):
        return "property"
    if callable(value):
        return f"method{inspect.signature(value)}"
    return f"attribute = {value!r}"


def surface() -> dict:
    from .attention import AttentionOps
    from .platform import CONTRACT_VERSION, Platform

    members = {}
    for cls in (Platform, AttentionOps):
        for name, value in vars(cls).items():
            if not name.startswith("_"):
                members[f"{cls.__name__}.{name}"] = _describe(value)
    return {"version": CONTRACT_VERSION, "members": members}


if __name__ == "__main__":
    print(json.dumps(surface(), indent=2, sort_keys=True))
