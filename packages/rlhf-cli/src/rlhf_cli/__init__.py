"""rlhf-cli: the ``rlhf`` command, and the Python API it is a layer over (``from rlhf_cli import train``)."""

import importlib.metadata

# The version lives in pyproject.toml only; an installed distribution reports it.
__version__ = importlib.metadata.version("rlhf-cli")


def __getattr__(name: str):
    # imported on first use: loading rlhf-cli's plugin entry point (every process that loads plugins) stays light
    if name in ("train", "RunResult"):
        from rlhf_cli import api

        return getattr(api, name)
    if name in ("primitives", "Primitives"):
        from rlhf_cli import build

        return getattr(build, name)
    raise AttributeError(f"module 'rlhf_cli' has no attribute {name!r}")
