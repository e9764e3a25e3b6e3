"""rlhf-agents registrations, loaded through its ``rlhf`` entry point like any third-party plugin (the package
README, "Writing an environment plugin", shows a third-party one)."""

from rlhf_agents.executors import MultiTurnAgentExecutor, SingleTurnAgentExecutor
from rlhf_agents.openai_server import OpenAIServerAgentExecutor
from rlhf_agents.prm_reward import PRMRewardFactory
from rlhf_agents.rewards import HttpRewardFactory, PythonFileRewardFactory, RewardModelFactory
from rlhf_core import hookimpl


@hookimpl
def rlhf_register_agent_executors(register):
    register("single_turn", SingleTurnAgentExecutor)
    register("multi_turn", MultiTurnAgentExecutor)
    register("openai_server", OpenAIServerAgentExecutor)


@hookimpl
def rlhf_register_reward_sources(register):
    register("python_file", PythonFileRewardFactory())
    register("http", HttpRewardFactory())
    register("reward_model", RewardModelFactory())
    register("prm", PRMRewardFactory())
