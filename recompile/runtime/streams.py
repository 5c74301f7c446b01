"""Where a compiled call runs, and handing values between CUDA streams.

The program runs where its inputs are: a call whose arguments (or the
parameters of a module among them) live on a CUDA device runs there. In
threaded mode each worker issues its work on its own stream of that device,
so independent frames overlap on the GPU. A value made on one stream and used
on another is handed over with an event: the consumer's stream waits for the
event (the host does not), and the value's memory is marked as used by the
consumer's stream so the caching allocator does not reuse it too early. The
only host synchronisations left are the ones the program asks for itself,
such as reading a predicate.
"""

from __future__ import annotations

import torch
from torch import nn

from ..autodiff.backprop import tensors_in
from .batch import Batch


def device_of(args):
    """The CUDA device index the call on ``args`` runs on, or None for the CPU: the first argument whose
    first tensor (a module's: first parameter) is on a CUDA device says which."""
    for value in args:
        if isinstance(value, Batch):  # (a batched argument of recompile.vmap)
            value = value.tensor if value.tensor is not None else value.items
        first = (next(value.parameters(), None) if isinstance(value, nn.Module)
                 else next(tensors_in(value), None))  # (lazily: a linked structure is walked to its first tensor)
        if first is not None and first.is_cuda:
            return first.device.index
    return None


class Handoff:
    """Values made on ``stream`` up to the moment ``event`` was recorded."""

    __slots__ = ("stream", "event", "values")

    def __init__(self, device, values):
        self.stream = torch.cuda.current_stream(device)
        self.event = torch.cuda.Event()
        self.event.record(self.stream)
        self.values = values

    def receive(self, stream):
        """Make ``stream`` (the consumer's) wait for the values, without blocking the host."""
        if stream == self.stream:
            return
        stream.wait_event(self.event)
        for t in tensors_in(self.values):
            if t.is_cuda:
                t.record_stream(stream)


def handoff(device, values):
    """A Handoff of ``values`` from the current stream, or None on the CPU."""
    return None if device is None else Handoff(device, values)
