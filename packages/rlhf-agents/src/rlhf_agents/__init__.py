"""rlhf-agents: how experience is collected, token in and token out: agent executors, reward sources, the
:class:`RolloutWorker`, ``rlhf serve-rm`` and a math-answer verifier. The package README describes each."""

import importlib.metadata

from rlhf_agents.executors import (
    AgentExecutorBase,
    AgentInstanceBase,
    MultiTurnAgentExecutor,
    SingleTurnAgentExecutor,
    TokenTrace,
)
from rlhf_agents.loading import UserCodeError
from rlhf_agents.math_answers import extract_boxed_answer, grade_answer
from rlhf_agents.openai_server import OpenAIServerAgentExecutor
from rlhf_agents.plugin import build_executor
from rlhf_agents.rewards import (
    HttpRewardSource,
    PythonFileRewardSource,
    RewardModelSource,
    WeightedRewardSource,
    build_reward_source,
)
from rlhf_agents.worker import RolloutFailureError, RolloutWorker, retokenization_drift

# The version lives in pyproject.toml only; an installed distribution reports it.
__version__ = importlib.metadata.version("rlhf-agents")
__all__ = [
    "AgentExecutorBase",
    "AgentInstanceBase",
    "HttpRewardSource",
    "MultiTurnAgentExecutor",
    "OpenAIServerAgentExecutor",
    "PythonFileRewardSource",
    "RewardModelSource",
    "RolloutFailureError",
    "RolloutWorker",
    "SingleTurnAgentExecutor",
    "TokenTrace",
    "UserCodeError",
    "WeightedRewardSource",
    "build_executor",
    "build_reward_source",
    "extract_boxed_answer",
    "grade_answer",
    "retokenization_drift",
]
