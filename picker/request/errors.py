"""Request errors and their HTTP form: an OpenAI-style JSON error body."""

from __future__ import annotations

import orjson

# The reference EPP's error codes and the HTTP status each maps to.
STATUS_BY_CODE = {
    "BadRequest": 400,
    "Unauthorized": 401,
    "Forbidden": 403,
    "NotFound": 404,
    "PayloadTooLarge": 413,
    "ResourceExhausted": 429,
    "Internal": 500,
    "ServiceUnavailable": 503,
}

_OPENAI_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class RequestError(Exception):
    """A request the picker answers itself, with `status` and an OpenAI-style body."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param

    @property
    def status(self) -> int:
        return STATUS_BY_CODE[self.code]

    def body(self) -> bytes:
        return orjson.dumps(
            {
                "error": {
                    "message": self.message,
                    "type": _OPENAI_TYPE_BY_STATUS.get(self.status, "server_error"),
                    "param": self.param,
                    "code": self.code,
                }
            }
        )

    def __repr__(self) -> str:
        return f"RequestError({self.code!r}, {self.message!r})"


def bad_request(message: str, param: str | None = None) -> RequestError:
    return RequestError("BadRequest", message, param)
