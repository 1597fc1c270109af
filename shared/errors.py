"""The one exception type for a request the engine refuses; servers turn it into a 400."""
from __future__ import annotations


class InvalidRequestError(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
