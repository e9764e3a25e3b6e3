"""OpenRLHF's reward and agent files run as they are: their ``openrlhf`` import lines, copied from OpenRLHF's
examples, are served by rlhf when OpenRLHF is not installed, and a real OpenRLHF install wins.

Each case runs in a fresh interpreter: the stand-in finder is process-wide, and so is ``sys.modules``.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

# The import lines of OpenRLHF's examples/python files (math_reward_func.py; agent_func.py and
# agent_func_gem_multiturn.py; vlm_multiturn_agent.py and the agent template of its README).
MATH_REWARD = "from openrlhf.utils import extract_boxed_answer, grade_answer\n"
AGENT_BASES = "from openrlhf.utils.agent import AgentExecutorBase, AgentInstanceBase\n"
MULTI_TURN = "from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor\n"

REWARD_BODY = """
import torch


def reward_func(queries, prompts, labels, **kwargs):
    rewards = [1.0 if grade_answer(extract_boxed_answer(q[len(p):]), label) else 0.0
               for q, p, label in zip(queries, prompts, labels)]
    return {"rewards": torch.tensor(rewards), "scores": torch.tensor(rewards)}
"""

AGENT_BODY = """

class AgentInstance(AgentInstanceBase):
    async def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        return {"rewards": 1.0, "scores": 1.0, "environment_feedback": "", "done": True}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""

RUN = """
import json, sys
from types import SimpleNamespace
from rlhf_agents.plugin import executor_class
from rlhf_agents.loading import UserCodeError
from rlhf_agents.rewards import PythonFileRewardSource

kind, path = sys.argv[1], sys.argv[2]
try:
    if kind == "reward":
        source = PythonFileRewardSource(path)
        out = source.func(["Q: 1+1? \\\\boxed{2}", "Q: 1+1? \\\\boxed{3}"], ["Q: 1+1? ", "Q: 1+1? "], ["2", "2"])
        result = [float(x) for x in out["rewards"]]
    else:
        cfg = SimpleNamespace(train=SimpleNamespace(agent_func_path=path, agent_executor=None, env=None, agent_command=None,
                                                 per_call_samples="auto"))
        cls, args = executor_class(cfg)
        result = [cls.__mro__[1].__module__, type(cls(*args)).__name__]
    print(json.dumps({"ok": result, "openrlhf": sys.modules["openrlhf"].__doc__ or sys.modules["openrlhf"].__file__}))
except UserCodeError as exc:
    print(json.dumps({"error": str(exc)}))
"""


def run(tmp_path, kind: str, source: str, extra_path: str | None = None) -> dict:
    user_file = tmp_path / f"{kind}.py"
    user_file.write_text(source)
    env = dict(os.environ)
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [extra_path, env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", RUN, kind, str(user_file)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_openrlhf_math_reward_file_runs_unchanged(tmp_path):
    out = run(tmp_path, "reward", MATH_REWARD + REWARD_BODY)
    assert out["ok"] == [1.0, 0.0]
    assert "stand-in" in out["openrlhf"]


@pytest.mark.parametrize("imports", [AGENT_BASES + MULTI_TURN, MULTI_TURN])
def test_openrlhf_agent_file_runs_unchanged(tmp_path, imports):
    out = run(tmp_path, "agent", imports + AGENT_BODY)
    assert out["ok"] == ["rlhf_agents.executors", "AgentExecutor"]


def test_a_name_rlhf_does_not_serve_says_which_it_does(tmp_path):
    out = run(tmp_path, "reward", "from openrlhf.utils import get_tokenizer\n" + REWARD_BODY)
    assert "openrlhf.utils.get_tokenizer is OpenRLHF's, which is not installed" in out["error"]
    assert (
        "openrlhf.utils.grade_answer" in out["error"]
        and "openrlhf.utils.agent.MultiTurnAgentExecutor" in out["error"]
    )


def test_a_real_openrlhf_install_wins(tmp_path):
    site = tmp_path / "site"
    (site / "openrlhf" / "utils").mkdir(parents=True)
    (site / "openrlhf" / "__init__.py").write_text("")
    (site / "openrlhf" / "utils" / "__init__.py").write_text(
        textwrap.dedent("""
        def extract_boxed_answer(text):
            return "always"

        def grade_answer(given, truth):
            return given == "always"
    """)
    )
    out = run(tmp_path, "reward", MATH_REWARD + REWARD_BODY, extra_path=str(site))
    assert out["ok"] == [1.0, 1.0]  # OpenRLHF's own helpers answered, not rlhf's
    assert out["openrlhf"].startswith(str(site))
