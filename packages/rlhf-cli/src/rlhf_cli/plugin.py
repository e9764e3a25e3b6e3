"""rlhf-cli registrations, loaded through its ``rlhf`` entry point like any third-party plugin."""

from rlhf_core import hookimpl  # noqa: F401
