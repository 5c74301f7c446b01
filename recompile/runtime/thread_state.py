"""The caller's thread-local torch modes, carried to the worker threads that run its work.

Grad mode, inference mode, autocast and the default device are per thread
in torch: a worker runs a call's frames under the modes of the thread that
made the call, so a call under ``torch.no_grad()``, ``torch.inference_mode()``,
``torch.autocast(...)`` or ``torch.device(...)`` means the same in every mode.
(Other torch function and dispatch modes, and saved-tensor hooks, stay with
the calling thread.)
"""

from __future__ import annotations

import contextlib

import torch

_AUTOCAST_DEVICES = ("cpu", "cuda")


class ThreadState:
    __slots__ = ("grad", "inference", "autocast", "device")

    def __init__(self):
        """The modes of the calling thread, now."""
        self.grad = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()
        self.autocast = [(device, torch.get_autocast_dtype(device)) for device in _AUTOCAST_DEVICES
                         if torch.is_autocast_enabled(device)]
        device = torch.get_default_device()
        self.device = device if device.type != "cpu" else None

    def applied(self):
        """Put this thread in the modes: grad mode at once (a worker's task sets its own, so nothing is
        restored), the others for the duration of the returned context."""
        if torch.is_grad_enabled() != self.grad:
            torch.set_grad_enabled(self.grad)
        if not self.inference and not self.autocast and self.device is None:
            return contextlib.nullcontext()
        modes = contextlib.ExitStack()
        if self.device is not None:
            modes.enter_context(torch.device(self.device))
        if self.inference:
            modes.enter_context(torch.inference_mode())
        for device, dtype in self.autocast:
            modes.enter_context(torch.autocast(device, dtype=dtype))
        return modes
