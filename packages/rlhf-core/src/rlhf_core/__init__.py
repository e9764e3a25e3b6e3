"""rlhf-core: the seam contracts, the plugin system and configuration that every rlhf package shares.

A plugin needs one import::

    from rlhf_core import hookimpl
"""

import importlib.metadata

from rlhf_core.errors import UserError
from rlhf_core.hookspecs import hookimpl
from rlhf_core.plugins import PluginError, collect, describe, get_plugin_manager, resolve

# The version lives in pyproject.toml only; an installed distribution reports it.
__version__ = importlib.metadata.version("rlhf-core")
__all__ = ["PluginError", "UserError", "collect", "describe", "get_plugin_manager", "hookimpl", "resolve"]
