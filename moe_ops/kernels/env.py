"""The kernels' switches from the environment, read at import (a launch pays no lookup), each
checked so that a mistyped value names its variable instead of passing unnoticed."""
from __future__ import annotations

import os


def env_choice(name: str, default: str, choices: tuple) -> str:
    """The value of environment variable `name` (default when unset), one of `choices`."""
    value = os.environ.get(name, default)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def env_int(name: str, default: int) -> int:
    """The value of environment variable `name` as a non-negative integer (default when unset)."""
    value = os.environ.get(name)
    if value is None:
        return default
    if not value.isdigit():
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)
