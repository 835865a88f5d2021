"""Errors the engine reports to its callers."""

from __future__ import annotations


class InvalidParameter(ValueError):
    """A request parameter is out of range; `field` names it so servers can report it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.detail = message

    def renamed(self, field: str) -> InvalidParameter:
        """The same refusal naming the field as a protocol calls it."""
        return self if field == self.field else InvalidParameter(field, self.detail)


class RequestFailed(RuntimeError):
    """The engine ended one request because handling it raised (a bug, not the client's fault:
    HTTP 500); every other request goes on. The engine's log has the traceback."""


def rejection_error(field: str | None, message: str, internal: bool) -> Exception:
    """The exception a frontend raises for the core's RequestRejected."""
    return RequestFailed(message) if internal else InvalidParameter(field or "request", message)


class EngineFailure(RuntimeError):
    """The engine core cannot go on (a worker or the frontend is gone); the message says why."""


def validation_error_parts(error: Exception) -> tuple[str | None, str]:
    """msgspec's "Expected `int`, got `str` - at `$.n`" as ("n", "Expected `int`, got `str`");
    (None, the whole text) when it names no place below the root."""
    text = str(error)
    message, found, path = text.rpartition(" - at `$")
    if not found:
        return None, text
    return path.rstrip("`").lstrip(".") or None, message
