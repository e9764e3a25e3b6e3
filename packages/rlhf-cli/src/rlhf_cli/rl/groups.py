"""The worker groups of an RL run, and the error the driver raises when one of their workers dies."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from rlhf_core.errors import UserError
from rlhf_core.handles import Future, Handle, wait, worker_died
from rlhf_core.types import TrainGroup


class RLRunError(UserError, RuntimeError):
    """The run cannot go on; the message names the worker, file or setting at fault."""


@dataclass
class Groups:
    """The worker groups of a run (None where the run does not need the role)."""

    actor: TrainGroup
    rollout: list[Handle]  # of RolloutActors
    ref: TrainGroup | None = None
    critic: TrainGroup | None = None
    reward: TrainGroup | None = None
    rollout_in_actor: bool = False
    """Engine ``i`` lives in actor rank ``i``'s process (``rlhf_cli.placement.roles_in_actor``)."""
    new_engine: Callable[[int], Handle] | None = None
    """Starts a fresh engine actor ``i`` on engine ``i``'s placement, to replace a dead one; None where an engine
    cannot be replaced (hosted in a rank, or no Ray)."""

    def trainers(self) -> list:
        """The groups that hold training state (what ``--ds.enable_sleep`` takes off the devices)."""
        return [g for g in (self.actor, self.critic, self.ref) if g is not None]


@contextmanager
def dead_worker_reported(message: str):
    """Re-raise the error of a dead worker (``rlhf_core.handles.worker_died``) as :class:`RLRunError`
    ``"{message}: {Ray's error}"``."""
    try:
        yield
    except worker_died() as exc:
        raise RLRunError(f"{message}: {exc}") from exc


@contextmanager
def trainers_asleep(trainers: list, asleep: bool):
    """``trainers``' state off the devices while the block runs, when ``asleep`` (``--train.colocate_all
    --ds.enable_sleep``: generation then has the devices)."""
    for g in trainers if asleep else []:
        g.sleep()
    yield
    for g in trainers if asleep else []:
        g.wake_up()


def wait_for(futures: Future | list[Future], role: str) -> Any:
    """``rlhf_core.handles.wait`` that names the role whose worker died."""
    with dead_worker_reported(f"a {role} worker died"):
        return wait(futures)
