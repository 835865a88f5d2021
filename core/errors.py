"""Errors the engine reports to its callers."""


class InvalidParameter(ValueError):
    """A request parameter is out of range; `field` names it so servers can report it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
