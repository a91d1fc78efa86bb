"""The small vocabularies plans and nodes are described in.

Each member is also its string value (``Placement.HOST == "host"``, ``f"{Policy.KEEP}"`` is
``keep``), so printed programs, JSON and messages read as before, and a typo in a literal
becomes a ``ValueError`` where a string is turned into a member (``Policy("recomptue")``).
"""
from __future__ import annotations

import enum


class _Vocabulary(str, enum.Enum):
    # str() and format() give the value on every Python version (3.10's Enum gave the name).
    __str__ = str.__str__
    __format__ = str.__format__


class Policy(_Vocabulary):
    """What happens to a value the backward reads: saved on the device, copied to the host
    and back, or replayed in the backward."""

    KEEP = "keep"
    OFFLOAD = "offload"
    RECOMPUTE = "recompute"


class Role(_Vocabulary):
    PARAM = "param"
    INPUT = "input"
    TANGENT = "tangent"
    SAVED = "saved"
    COMPUTE = "compute"
    MEMORY = "memory"
    OUTPUT = "output"


class Phase(_Vocabulary):
    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"  # a forward op replayed in the backward


class Placement(_Vocabulary):
    HOST = "host"
    DEVICE = "device"
