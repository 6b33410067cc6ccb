"""fencepost.v1.TestHooks: TEST-ONLY hooks for the fault-injection harness.

Registered only when the server runs with ``--test-hooks`` (app.py); a normal
server does not have this service at all, so its calls are UNIMPLEMENTED.
"""

from __future__ import annotations

from typing import Any

import grpc

from fencepost.v1 import testing_pb2 as pb
from fencepost.v1 import testing_pb2_grpc

from ..core.errors import validation
from .status import handler

MAX_JUMP_MS = 24 * 60 * 60 * 1000


class TestHooksService(testing_pb2_grpc.TestHooksServicer):
    """Moves the server's clock forward (an ``OffsetClock``, or a ``ManualClock``
    in-process)."""

    __test__ = False  # not a pytest test class

    def __init__(self, clock: Any) -> None:
        self.clock = clock

    @handler
    async def JumpClock(
        self, request: pb.JumpClockRequest, context: grpc.aio.ServicerContext
    ) -> pb.JumpClockResponse:
        if not 0 <= request.ms <= MAX_JUMP_MS:
            raise validation("ms", f"must be 0 - {MAX_JUMP_MS}")
        jump = getattr(self.clock, "jump", None) or self.clock.advance
        return pb.JumpClockResponse(now_ms=jump(request.ms))
