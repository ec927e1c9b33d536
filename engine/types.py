"""Identifiers and the engine's error hierarchy (torch-free)."""
from __future__ import annotations

from typing import NewType

RequestId = NewType("RequestId", str)
BlockId = NewType("BlockId", int)
BlockHash = NewType("BlockHash", bytes)


class EngineError(Exception):
    """Base class of errors raised by the engine."""


class UnsupportedModelError(EngineError):
    """The checkpoint uses an architecture or config field the engine cannot run."""


class InvalidRequestError(EngineError, ValueError):
    """A request the engine refuses: the message says which field and why."""


class InvariantError(EngineError, AssertionError):
    """Block accounting is broken: a bug, never a capacity shortage."""
