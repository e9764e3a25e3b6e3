"""rlhf-cli."""

import importlib.metadata

# The version lives in pyproject.toml only; an installed distribution reports it.
__version__ = importlib.metadata.version("rlhf-cli")
