"""The server's one error type: OpenAI's error shape {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def cancelled(shutdown: bool) -> APIError:
    """A request the server cut short: a 503 before the status line, an event + [DONE] after it. shutdown:
    uvicorn cancelled it, --shutdown-timeout having run out."""
    why = "the server is shutting down" if shutdown else "client gone or server shutting down"
    return APIError(503, f"the request was cancelled ({why})", None, "cancelled", "server_error")
