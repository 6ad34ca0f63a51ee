"""The server's errors: an HTTP status with OpenAI's error body, and how a bad value is shown.

`ApiError(status, message, param)` is what every check of a request raises (protocol.py,
tools.py) and what the routes answer (api.py): `{"error": {"message", "type", "param", "code"}}`,
`param` naming the field.
"""

from __future__ import annotations


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> ApiError:
    """A 400 naming the field."""
    return ApiError(400, message, param)


def show(value) -> str:
    """A client's value in a message, cut to 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
