"""Structured outputs in the worker: the step's token masks, as a future.

The core computes a step's masks (one bitmask row per constrained request that samples) while
the workers run its forward pass, and sends them to rank 0 right after the step
(core.protocol.StepMasks). The shell hands the step executor a `StepMasksFuture`; the
executor asks for the masks only when it samples, and the sampler applies them. The grammars
themselves live in the core (core/scheduling/structured.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagedllm.core.outputs import SchedulerOutput
from pagedllm.core.protocol import StepMasks


def step_masks(plan: SchedulerOutput, is_first: bool, expect: Callable) -> StepMasksFuture | None:
    """The future of the plan's masks on rank 0 where the plan has constrained requests that
    sample (`expect(kind)`: the worker's next message, of that kind), else None."""
    if not plan.structured_request_ids or not is_first:
        return None
    return StepMasksFuture(plan, lambda: expect(StepMasks))


class StepMasksFuture:
    def __init__(self, plan: SchedulerOutput, receive: Callable[[], StepMasks]):
        self.plan, self._receive = plan, receive
        self._masks: dict[str, torch.Tensor] | None = None

    def result(self) -> dict[str, torch.Tensor]:
        """Each constrained request's bitmask for this step, by id (waits for the message once)."""
        if self._masks is None:
            msg = self._receive()
            if msg.step_id != self.plan.step_id:
                raise RuntimeError(f"masks of step {msg.step_id} came for step {self.plan.step_id}")
            masks = torch.from_numpy(np.array(msg.bitmask))  # a copy: the frame's buffer is read-only
            self._masks = dict(zip(self.plan.structured_request_ids, masks))
        return self._masks
