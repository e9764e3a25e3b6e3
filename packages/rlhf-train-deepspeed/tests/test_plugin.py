"""The backend is found through the ``rlhf`` entry points and maps configs to model specs."""

from __future__ import annotations

import pytest

from rlhf_core.config import RLConfig, SupervisedConfig
from rlhf_core.plugins import get_plugin_manager, resolve
from rlhf_core.types import TrainBackend
from rlhf_train_deepspeed.backend import spec_for_role
from rlhf_train_deepspeed.strategy import ConfigError
from rlhf_train_deepspeed.trainers import BatchPlan, run_supervised


def test_registered_as_the_deepspeed_train_backend():
    backend = resolve(get_plugin_manager(), "train_backends", "deepspeed", "--train.backend")
    assert isinstance(backend, TrainBackend)


def test_roles_map_to_models():
    cfg = RLConfig()
    cfg.actor.model_name_or_path = "/m/actor"
    cfg.reward.model_name_or_path = "/m/rm"
    cfg.reward.normalize_enable = True
    cfg.train.batch_size, cfg.train.micro_batch_size = 64, 4
    actor = spec_for_role("actor", cfg, num_workers=2, total_steps=100)
    assert (actor.kind, actor.trainable, actor.grad_accum, actor.total_steps) == ("causal", True, 8, 100)
    assert spec_for_role("critic", cfg, 2).path == "/m/rm"  # the critic starts from the reward model
    assert spec_for_role("ref", cfg, 1).path == "/m/actor"
    reward = spec_for_role("reward", cfg, 1)
    assert (reward.kind, reward.trainable, reward.normalize_reward) == ("value", False, True)
    with pytest.raises(ValueError, match="unknown role 'policy'"):
        spec_for_role("policy", cfg, 1)


def test_batch_sizes_must_divide():
    cfg = SupervisedConfig()
    cfg.model.num_gpus_per_node = 2
    cfg.train.batch_size, cfg.train.micro_batch_size = 12, 4
    with pytest.raises(
        ConfigError, match="--train.batch_size 12 must be a multiple of --train.micro_batch_size 4 x 2 ranks"
    ):
        BatchPlan.from_config(cfg)
    cfg.train.batch_size = 16
    assert BatchPlan.from_config(cfg).grad_accum == 2
    with pytest.raises(ConfigError, match="unknown trainer mode 'ppo'"):
        run_supervised("ppo", cfg)
