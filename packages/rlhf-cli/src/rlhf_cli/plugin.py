"""rlhf-cli registrations, loaded through its ``rlhf`` entry point like any third-party plugin."""

from rlhf_cli.placement import BUILTIN
from rlhf_core import hookimpl


@hookimpl
def rlhf_register_placement_strategies(register):
    for strategy in BUILTIN:
        register(strategy.name, strategy)
