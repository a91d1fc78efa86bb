"""The working memory a fused op makes inside itself, reported to whoever measures memory.

An op that loops over chunks (the fused LM head, a token-chunked run) allocates buffers the
CPU stand-in's tracker cannot see, since it sees op outputs only. Such ops pass each buffer
through ``tracked``. While ``observe(track)`` is active, ``track`` sees every one of them, so the
planned and the measured peaks count the same tensors. On CUDA the allocator sees everything
anyway, so nothing observes there.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import torch

_observer: contextvars.ContextVar[Callable[[torch.Tensor], None] | None] = contextvars.ContextVar(
    "megatrain_workspace_observer", default=None)


@contextlib.contextmanager
def observe(track: Callable[[torch.Tensor], None]):
    """While active, every tensor a fused op passes to ``tracked`` is passed to ``track``."""
    token = _observer.set(track)
    try:
        yield
    finally:
        _observer.reset(token)


def tracked(t):
    """``t``, reported to the active observer (if any, and if ``t`` is a tensor)."""
    track = _observer.get()
    if track is not None and isinstance(t, torch.Tensor):
        track(t)
    return t


def observing() -> bool:
    """Whether an observer is active (an op may then run a slower path that reports every value)."""
    return _observer.get() is not None
