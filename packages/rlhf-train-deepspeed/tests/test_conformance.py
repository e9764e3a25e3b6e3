"""The DeepSpeed backend against rlhf-core's train-backend suite (the contract the RL controller speaks)."""

import pytest

from rlhf_core.testing import TrainBackendConformance

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]


class TestDeepSpeedBackend(TrainBackendConformance):
    name = "deepspeed"
    flags = ["--ds.param_dtype", "fp32", "--ds.zero_stage", "2"]
