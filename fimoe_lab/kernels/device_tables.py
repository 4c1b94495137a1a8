"""Host index tables copied to a device once, kept, and safe to read from any stream.

A copy queued without waiting for its stream (``non_blocking``) is ordered only on the stream that queued it: a
launch on that stream reads the table after it lands, a launch on another stream may read it before. A
:class:`DeviceTables` records an event after its copies; until that event has completed, each use makes the stream
in use wait for it (on the queuing stream that wait is already satisfied by the stream's order). Once the event has
completed, a use is an attribute read.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["DeviceTables"]


class DeviceTables:
    """``arrays`` copied to ``device``: without ``wait`` the copies are queued on the current stream and an event is
    recorded after them; with ``wait`` (a thread whose stream is not the caller's) they are complete on return."""

    __slots__ = ("_tensors", "_done")

    def __init__(self, arrays: tuple[np.ndarray, ...], device: torch.device, wait: bool) -> None:
        self._tensors = tuple(torch.from_numpy(a).to(device, non_blocking=not wait) for a in arrays)
        self._done: torch.cuda.Event | None = None
        if not wait and self._tensors[0].is_cuda:
            self._done = torch.cuda.Event()
            self._done.record(torch.cuda.current_stream(self._tensors[0].device))

    def ready(self) -> tuple[torch.Tensor, ...]:
        """The tables, readable by launches queued next on the current stream."""
        done = self._done
        if done is not None:
            if done.query():
                self._done = None
            else:
                torch.cuda.current_stream(self._tensors[0].device).wait_event(done)
        return self._tensors
