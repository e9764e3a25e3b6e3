"""Checking what user code returns, and logging its failures once."""

from __future__ import annotations

import logging
import math
import traceback
from typing import Any

_logged: set[tuple[str, ...]] = set()


def describe(value: Any) -> str:
    """A short description of a value for error messages: its type, and shape or length when it has one."""
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"{type(value).__name__} of shape {tuple(shape)}"
    if isinstance(value, (list, tuple, dict)):
        return f"{type(value).__name__} of length {len(value)}"
    text = repr(value)
    return f"{type(value).__name__} ({text[:40]}{'...' if len(text) > 40 else ''})"


def to_float(value: Any) -> float:
    """A Python float from a number, or a one-element torch tensor or numpy value; raises TypeError naming
    what the value was. NaN and Inf pass through: callers decide what they mean."""
    if isinstance(value, (bool, int, float)):
        return float(value)
    item = getattr(value, "item", None)
    size = value.numel() if hasattr(value, "numel") else getattr(value, "size", None)
    if callable(item) and size == 1:
        return float(item())
    raise TypeError(f"expected a number, got {describe(value)}")


def numeric_logs(logs: Any, logger: logging.Logger, where: str) -> dict[str, float]:
    """User code's ``extra_logs`` as floats; a value that is not a number is logged once and dropped."""
    out = {}
    for key, value in (logs or {}).items():
        try:
            out[key] = to_float(value)
        except TypeError as exc:
            log_failure_once(logger, where, f"extra_logs[{key!r}] is not logged: {exc}")
    return out


def check_reward_value(value: Any, what: str = "reward") -> tuple[float | None, str | None]:
    """``(value as a float, None)`` for a finite number, else ``(None, why the <what> is unscorable)``."""
    if value is None:
        return None, f"{what} is None"
    try:
        number = to_float(value)
    except TypeError as exc:
        return None, f"{what} has the wrong type: {exc}"
    if not math.isfinite(number):
        return None, f"{what} is {number}"
    return number, None


def log_failure_once(
    logger: logging.Logger, where: str, message: str, exc: BaseException | None = None
) -> None:
    """Log a failure of user code with its traceback the first time it is seen, at debug level after that.
    Keyed by ``where`` and the frame that raised: one bad line logs one traceback however many samples hit
    it."""
    key: tuple[str, ...] = (where, message if exc is None else type(exc).__name__)
    if exc is not None and exc.__traceback__ is not None:
        last = traceback.extract_tb(exc.__traceback__)[-1]
        key += (last.filename, str(last.lineno))
    if key in _logged:
        logger.debug("%s: %s", where, message)
        return
    _logged.add(key)
    trace = (
        "" if exc is None else "\n" + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    )
    logger.error("%s: %s (further occurrences are counted, not logged)%s", where, message, trace)
