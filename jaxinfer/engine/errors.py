"""The error every request check raises: a `ValueError` that names the offending field.

Front ends map `field` to their wire names (HTTP 400 with OpenAI's `param`, gRPC
INVALID_ARGUMENT) instead of parsing messages. No jax here.
"""

from __future__ import annotations


class RequestError(ValueError):
    """A request is invalid; nothing of it was queued.

    Attributes:
        field: The request field at fault (a `SamplingParams` field name, "prompt",
            "request_id", ...), or None when the request as a whole is at fault.
        message: What is wrong, for people.
    """

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message
