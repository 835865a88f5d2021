"""Multi-LoRA in the core: which adapters a step may hold. The worker keeps max_loras adapters
resident (backends/lora.py); a step's rows may use at most that many, the running requests'
adapters first. The scheduler asks at two named points, when it admits swapped and waiting
requests."""

from __future__ import annotations

from ..request import Request


class StepAdapters:
    """The adapters of one step being built: the running requests', and those admitted since."""

    __slots__ = ("held", "limit")

    def __init__(self, running: list[Request], limit: int):
        self.held = {r.lora.lora_int_id for r in running if r.lora is not None}
        self.limit = limit

    def admits(self, request: Request) -> bool:
        """Whether the step may take `request`'s adapter (the base model, or one it holds, or
        one more while a slot is left); taken, the step holds it."""
        if request.lora is None or request.lora.lora_int_id in self.held:
            return True
        if len(self.held) >= self.limit:
            return False
        self.held.add(request.lora.lora_int_id)
        return True


class Adapters:
    """The scheduler's LoRA component (None where the engine serves no adapters)."""

    def __init__(self, max_loras: int):
        self.max_loras = max_loras

    def for_step(self, running: list[Request]) -> StepAdapters:
        return StepAdapters(running, self.max_loras)
