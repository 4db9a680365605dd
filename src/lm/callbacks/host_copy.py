"""HostCopy: a device tensor copied to host memory without waiting for it, read later for that copy only.

Reading a device value on the host (`bool(t)`, `t.item()`, `t.tolist()`) waits for everything queued on the
stream so far, the next step's forward and backward included. A non-blocking copy into pinned memory with an
event recorded right after it lets the host read the value a step later and wait for nothing else. The
non-finite guard (found_inf, read a step late) and the ranks' consensus (an all-reduce, read a step late)
both stage their verdicts this way.
"""

from __future__ import annotations

import torch


class HostCopy:
    """`tensor`, staged to host memory at once (pinned and non-blocking on CUDA); `value()` waits for it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        cuda = tensor.is_cuda
        self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=cuda)
        self.host.copy_(tensor, non_blocking=cuda)
        self.host.host_staging = True  # lives on the host by construction (tests/callbacks/test_sync.py)
        self.event = torch.cuda.Event() if cuda else None
        if self.event is not None:
            self.event.record()

    def value(self) -> torch.Tensor:
        """The host copy, once the copy itself has finished (nothing queued after it is waited for)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host

    def __bool__(self) -> bool:
        return bool(self.value())
