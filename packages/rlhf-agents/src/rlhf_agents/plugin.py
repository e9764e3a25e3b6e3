"""rlhf-agents registrations, loaded through its ``rlhf`` entry point like any third-party plugin (the package
README, "Writing an environment plugin", shows a third-party one), and the executor factory: the one module that
knows every executor."""

from __future__ import annotations

import inspect
from typing import Any

from rlhf_agents import tool_parsers
from rlhf_agents.checks import describe
from rlhf_agents.command_agent import CommandAgentExecutor, command_argv
from rlhf_agents.executors import AgentExecutorBase, MultiTurnAgentExecutor, SingleTurnAgentExecutor
from rlhf_agents.loading import UserCodeError, load_symbol
from rlhf_agents.openai_server import PER_CALL_SAMPLES, OpenAIServerAgentExecutor
from rlhf_agents.prm_reward import PRMRewardFactory
from rlhf_agents.rewards import HttpRewardFactory, PythonFileRewardFactory, RewardModelFactory
from rlhf_core import hookimpl
from rlhf_core.config_parser import ConfigError
from rlhf_core.plugins import get_plugin_manager, resolve


@hookimpl
def rlhf_register_agent_executors(register):
    register("single_turn", SingleTurnAgentExecutor)
    register("multi_turn", MultiTurnAgentExecutor)
    register("openai_server", OpenAIServerAgentExecutor)


@hookimpl
def rlhf_register_tool_parsers(register):
    for name, parser in tool_parsers.BUILTIN.items():
        register(name, parser)


@hookimpl
def rlhf_register_reward_sources(register):
    register("python_file", PythonFileRewardFactory())
    register("http", HttpRewardFactory())
    register("reward_model", RewardModelFactory())
    register("prm", PRMRewardFactory())


def executor_class(cfg: Any, pm: Any = None) -> tuple[type, tuple]:
    """The executor class the config asks for and the arguments it is built with, checked without building it
    (the driver calls this before any worker starts, and ``--dry-run`` too).

    - ``--train.agent_command "..."``: ``CommandAgentExecutor`` with the command's argv (its program must exist).
    - ``--train.agent_func_path file.py``: the file's ``AgentExecutor`` class (the file is imported), no arguments.
    - ``--train.env NAME``: ``--train.agent_executor`` (default ``multi_turn``) with the registered environment.
    - otherwise ``--train.agent_executor NAME`` (default ``single_turn``), no arguments.

    Raises a UserError naming the flag or file when the class is missing, abstract, or cannot take the arguments.
    """
    train = cfg.train
    if train.per_call_samples not in PER_CALL_SAMPLES:
        raise ConfigError(
            f"--train.per_call_samples {train.per_call_samples!r}: choose one of "
            f"{', '.join(PER_CALL_SAMPLES)}"
        )
    if getattr(train, "tool_parser", None) is not None:  # (configs built by hand may lack the field)
        resolve(pm or get_plugin_manager(), "tool_parsers", train.tool_parser, "--train.tool_parser")
    if train.agent_command:
        others = [f for f in ("agent_func_path", "agent_executor", "env") if getattr(train, f)]
        if others:
            raise ConfigError(
                f"--train.agent_command is the agent; drop {', '.join('--train.' + f for f in others)}"
            )
        try:
            return CommandAgentExecutor, (command_argv(train.agent_command),)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    pm = pm if pm is not None else get_plugin_manager()
    if train.agent_func_path:
        path = train.agent_func_path
        cls = load_symbol(path, "AgentExecutor", "--train.agent_func_path")
        if not (isinstance(cls, type) and issubclass(cls, AgentExecutorBase)):
            raise UserCodeError(
                f"--train.agent_func_path {path}: AgentExecutor is a {describe(cls)}; expected a subclass of "
                f"rlhf_agents.AgentExecutorBase, e.g. class AgentExecutor(MultiTurnAgentExecutor)"
            )
        where, args, error = f"--train.agent_func_path {path}: AgentExecutor", (), UserCodeError
    else:
        name = train.agent_executor or ("multi_turn" if train.env else "single_turn")
        cls = resolve(pm, "agent_executors", name, flag="--train.agent_executor")
        args = (resolve(pm, "environments", train.env, flag="--train.env"),) if train.env else ()
        where, error = f"--train.agent_executor {name}", ConfigError
    if inspect.isabstract(cls):
        raise error(f"{where} leaves {', '.join(sorted(cls.__abstractmethods__))} unimplemented")
    if train.per_call_samples != "auto" and not issubclass(cls, OpenAIServerAgentExecutor):
        raise ConfigError(
            f"--train.per_call_samples {train.per_call_samples} applies to agents on the OpenAI "
            f"endpoint (--train.agent_command, or an OpenAIServerAgentExecutor); {where} records "
            f"its episodes as one trajectory by construction"
        )
    try:
        inspect.signature(cls).bind(*args)
    except TypeError as exc:
        hint = (
            ""
            if train.agent_func_path
            else ": multi_turn needs --train.env NAME, and openai_server a subclass in --train.agent_func_path"
        )
        raise error(f"{where} cannot be built from the flags ({exc}){hint}") from None
    return cls, args


def build_executor(cfg: Any, pm: Any = None) -> AgentExecutorBase:
    """The executor of :func:`executor_class`, built."""
    cls, args = executor_class(cfg, pm)
    path = cfg.train.agent_func_path
    try:
        executor = cls(*args)
    except Exception as exc:
        if not path:
            raise
        raise UserCodeError(
            f"--train.agent_func_path {path}: AgentExecutor() raised {type(exc).__name__}: {exc}"
        ) from exc
    executor.env_step_timeout = cfg.train.env_step_timeout
    executor.max_images = cfg.data.max_images_per_prompt
    executor.per_call_samples = cfg.train.per_call_samples  # read by the OpenAI-endpoint executors only
    executor.tool_parser = getattr(cfg.train, "tool_parser", None)
    return executor
