"""The base class of errors whose message is the whole story for the user."""

from __future__ import annotations


class UserError(Exception):
    """Something the user gave cannot work: a flag, a file, a dataset row, a model path, a plugin. The message
    names what is at fault and why; ``rlhf`` shows it alone, also from a Ray worker (docs/plugin-hooks.md)."""


def find_user_error(exc: BaseException) -> UserError | None:
    """The :class:`UserError` behind ``exc``, or None when ``exc`` is not one (a bug, not a user mistake).

    Ray re-raises a worker's exception as a ``RayTaskError`` that subclasses the original's type and keeps
    the original as ``.cause``; its own message is the worker's traceback, so the original is returned.
    An exception raised ``from`` a UserError counts as that UserError.
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        cause = getattr(exc, "cause", None)  # ray.exceptions.RayTaskError
        if isinstance(cause, BaseException):
            exc = cause
        elif isinstance(exc, UserError):
            return exc
        else:
            exc = exc.__cause__
    return None
