"""The rlhf_core reward-source conformance suite, run against the built-in python_file source."""

from rlhf_core.config import RLConfig
from rlhf_core.testing import RewardSourceConformance


class TestPythonFileRewardConformance(RewardSourceConformance):
    name = "python_file"

    def make_config(self, tmp_path):
        path = tmp_path / "reward.py"
        path.write_text(
            "def reward_func(queries, prompts, labels, **kwargs):\n"
            "    return [float(q.split('=')[-1].strip() == l) for q, l in zip(queries, labels)]\n"
        )
        cfg = RLConfig()
        cfg.reward.remote_url = str(path)
        return cfg

    def test_scores_match_the_function(self, tmp_path):
        import asyncio

        from rlhf_core.plugins import get_plugin_manager, resolve

        source = resolve(get_plugin_manager(), "reward_sources", self.name).create(self.make_config(tmp_path))
        result = asyncio.run(source.score(self.request()))
        assert result.rewards == [1.0, 0.0, 1.0]
