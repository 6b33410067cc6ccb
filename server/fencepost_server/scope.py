"""Whose request ids a command's are: the caller's principal when identities
are on (set by auth.guard for the call and the tasks it starts), else ""."""

from __future__ import annotations

import contextvars

REQUEST_SCOPE: contextvars.ContextVar[str] = contextvars.ContextVar(
    "fencepost_request_scope", default="")
