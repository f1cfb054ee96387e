"""Argument checks: every rejection names the argument, what was expected and what came.

All checks run on host-side metadata (shape, dtype, device, Python values) before any kernel
launch; none of them reads tensor data, so none forces a device-to-host sync.
"""
from __future__ import annotations

from typing import Any


class MoEArgumentError(ValueError):
    """A bad argument to a moe_ops function. A ValueError, so plain `except ValueError` works."""


def check(condition: bool, argument: str, expected: str, got: Any) -> None:
    if not condition:
        raise MoEArgumentError(f"{argument}: expected {expected}, got {got}")
