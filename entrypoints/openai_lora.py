"""LoRA adapters on the OpenAI API, as vLLM serves them: `--lora-modules name=path ...` names
adapters that a request's `model` field picks (the base model's name: none), /v1/models lists
them with the base as their parent, and where VLLM_ALLOW_RUNTIME_LORA_UPDATING is true (vLLM's
switch), POST /v1/load_lora_adapter and /v1/unload_lora_adapter change them at run time."""

from __future__ import annotations

import itertools
import json
import os

import msgspec
from starlette.responses import JSONResponse, Response

from pagedllm.core.errors import InvalidParameter
from pagedllm.core.lora import LoRARequest

from .openai_protocol import error_body

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
ADMIN_BODY_BYTES = 64 << 10  # the load and unload bodies: a name and a path


def runtime_updating() -> bool:
    return os.environ.get(RUNTIME_UPDATING_ENV, "").lower() in ("1", "true")


def parse_lora_module(spec: str) -> tuple[str, str]:
    """`name=path`, or vLLM's JSON form {"name": ..., "path": ...}: (name, path)."""
    if spec.lstrip().startswith("{"):
        try:
            obj = json.loads(spec)
            return str(obj["name"]), str(obj["path"])
        except (ValueError, KeyError, TypeError):
            raise InvalidParameter("lora_modules", f'{spec!r} is not {{"name": ..., "path": ...}}') from None
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise InvalidParameter("lora_modules", f"{spec!r} is not name=path")
    return name, path


class LoadLoRAAdapter(msgspec.Struct):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapter(msgspec.Struct):
    lora_name: str


class ServedAdapters:
    """The adapters a server answers to, by name; each checked (engine.inputs.adapter) when named.
    `engine`: an AsyncEngine."""

    def __init__(self, engine, base_name: str, modules: list[str]):
        self.engine, self.base_name = engine, base_name
        self.by_name: dict[str, LoRARequest] = {}
        self.ids = itertools.count(1)
        for spec in modules:
            try:
                self._add(*parse_lora_module(spec))
            except InvalidParameter as e:  # named as the flag that gave it
                raise e.renamed("lora_modules") from None

    def _add(self, name: str, path: str) -> LoRARequest:
        if name == self.base_name or name in self.by_name:
            raise InvalidParameter("lora_name", f"the lora adapter {name!r} has already been loaded")
        lora = self.engine.inputs.adapter(LoRARequest(name, next(self.ids), path))
        self.by_name[name] = lora
        return lora

    def of(self, model: str | None) -> LoRARequest | None:
        return self.by_name.get(model) if model else None

    def cards(self, created: int, max_model_len: int) -> list[dict]:
        return [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "pagedllm",
                "root": lora.lora_path,
                "parent": self.base_name,
                "max_model_len": max_model_len,
            }
            for name, lora in self.by_name.items()
        ]

    def load(self, req: LoadLoRAAdapter) -> Response:
        if not req.lora_name or not req.lora_path:
            raise InvalidParameter("lora_name", "both lora_name and lora_path are required")
        self._add(req.lora_name, req.lora_path)
        return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.", media_type="text/plain")

    def unload(self, req: UnloadLoRAAdapter) -> Response:
        if req.lora_name not in self.by_name:
            message = f"the lora adapter {req.lora_name!r} cannot be found"
            return JSONResponse(error_body(message, "invalid_request_error", "lora_name", None), status_code=404)
        del self.by_name[req.lora_name]
        return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", media_type="text/plain")
