"""rlhf-algos registrations, loaded through its ``rlhf`` entry point like any third-party plugin."""

from __future__ import annotations

from rlhf_algos.advantages import ADVANTAGE_ESTIMATORS
from rlhf_algos.kl import KL_ESTIMATORS
from rlhf_algos.policy_loss import POLICY_LOSSES
from rlhf_core import hookimpl
from rlhf_core.hookspecs import Register


@hookimpl
def rlhf_register_advantage_estimators(register: Register) -> None:
    for name, estimator in ADVANTAGE_ESTIMATORS.items():
        register(name, estimator)


@hookimpl
def rlhf_register_policy_losses(register: Register) -> None:
    for name, loss in POLICY_LOSSES.items():
        register(name, loss)


@hookimpl
def rlhf_register_kl_estimators(register: Register) -> None:
    for name, kl in KL_ESTIMATORS.items():
        register(name, kl)
