"""rlhf-train-deepspeed registrations, loaded through its ``rlhf`` entry point like any third-party plugin."""

from rlhf_core import hookimpl
from rlhf_core.hookspecs import Register


@hookimpl
def rlhf_register_train_backends(register: Register) -> None:
    from rlhf_train_deepspeed.backend import DeepSpeedBackend

    register("deepspeed", DeepSpeedBackend())
