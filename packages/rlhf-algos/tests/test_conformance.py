"""rlhf_core's conformance suites, run against every built-in estimator, policy loss and KL estimator."""

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
