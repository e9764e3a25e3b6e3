"""rlhf_core's conformance suites, run against every built-in estimator, policy loss and KL estimator."""

import dataclasses

from rlhf_core.testing import AdvantageEstimatorConformance, KLEstimatorConformance, PolicyLossConformance


class TestGAE(AdvantageEstimatorConformance):
    name = "gae"


class TestReinforce(AdvantageEstimatorConformance):
    name = "reinforce"


class TestReinforceBaseline(AdvantageEstimatorConformance):
    name = "reinforce_baseline"


class TestRLOO(AdvantageEstimatorConformance):
    name = "rloo"


class TestGroupNorm(AdvantageEstimatorConformance):
    name = "group_norm"


class TestDrGRPO(AdvantageEstimatorConformance):
    name = "dr_grpo"


class TestOPD(AdvantageEstimatorConformance):
    name = "opd"

    def make_batch(self, seed=0, groups=3, t=7):
        # with a task reward, so that the reward clip and the invalid samples' rewards have something to act on
        return dataclasses.replace(super().make_batch(seed, groups, t), task_reward_coef=0.5)


class TestPPO(PolicyLossConformance):
    name = "ppo"


class TestGSPO(PolicyLossConformance):
    name = "gspo"


class TestK1(KLEstimatorConformance):
    name = "k1"


class TestK2(KLEstimatorConformance):
    name = "k2"


class TestK3(KLEstimatorConformance):
    name = "k3"
