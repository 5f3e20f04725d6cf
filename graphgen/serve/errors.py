"""`ApiError`: an OpenAI-shaped error answer (status, type, param, code). Its own module so the
request parsers (protocol.py, tools.py, structured.py) share it without importing each other."""

from __future__ import annotations

from typing import Optional


class ApiError(Exception):
    def __init__(self, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                 status: int = 400, type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
