"""rlhf-agents: how experience is collected, token in and token out.

- Executors turn a prompt into a :class:`rlhf_core.types.Trajectory`: :class:`SingleTurnAgentExecutor`
  (generate once; the reward source scores it), :class:`MultiTurnAgentExecutor` (drives an
  :class:`AgentInstanceBase` environment, OpenRLHF's agent API) and :class:`OpenAIServerAgentExecutor`
  (agent code talks to a local OpenAI-compatible endpoint).
- Reward sources score batches: a Python ``reward_func`` file, HTTP reward servers, a reward model, and
  weighted combinations (:func:`build_reward_source`).
- :class:`RolloutWorker` runs a batch of prompts through an executor and a reward source; a Ray rollout
  actor hosts one.
- ``python -m rlhf_agents.serve_rm`` (``rlhf serve-rm``) serves a reward model over HTTP.
- :func:`extract_boxed_answer` and :func:`grade_answer` (:mod:`rlhf_agents.math_answers`) verify math answers
  in reward functions.

OpenRLHF's agent and math reward files run as they are: their ``from openrlhf.utils.agent import ...`` and
``from openrlhf.utils import extract_boxed_answer, grade_answer`` get these classes and functions when
OpenRLHF is not installed (:mod:`rlhf_agents.openrlhf_compat`).
"""

import importlib.metadata

from rlhf_agents.executors import (
    AgentExecutorBase,
    AgentInstanceBase,
    MultiTurnAgentExecutor,
    SingleTurnAgentExecutor,
    TokenTrace,
    build_executor,
)
from rlhf_agents.loading import UserCodeError
from rlhf_agents.math_answers import extract_boxed_answer, grade_answer
from rlhf_agents.openai_server import OpenAIServerAgentExecutor
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
