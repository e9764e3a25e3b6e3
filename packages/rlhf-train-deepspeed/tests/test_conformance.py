"""The DeepSpeed backend against rlhf-core's train-backend suite (the contract the RL controller speaks)."""

import pytest

from rlhf_core.testing import TrainBackendConformance

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]


class TestDeepSpeedBackend(TrainBackendConformance):
    name = "deepspeed"
    flags = ["--ds.param_dtype", "fp32", "--ds.zero_stage", "2"]

    @pytest.fixture(scope="class", autouse=True)
    def shared_ray(self, reused_groups):
        """The directory's Ray session (autouse: started before the suite's group), so the group outlives the class."""
        self.__class__.reused = reused_groups

    def release_group(self, group) -> None:
        # A group of 2 ranks the backend started: the directory's reused 2-rank group takes it over (init_model
        # replaces its model) instead of starting 2 more ranks (~25 s) for the next module's tests.
        reused = self.reused[2]
        if reused.group is None:
            reused.group = group
        else:
            group.shutdown()
