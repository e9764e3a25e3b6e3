"""Agents that are programs: ``--train.agent_command "..."`` runs one process per episode, in any language,
against the episode's OpenAI-compatible endpoint (:class:`OpenAIServerAgentExecutor`). The package README
("Agents as programs") has the whole contract: environment, stdin, stdout, time and failures."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import shutil
import signal
from typing import Any

from rlhf_agents.executors import EpisodeFailure
from rlhf_agents.openai_server import OpenAIServerAgentExecutor

logger = logging.getLogger(__name__)

STDERR_TAIL = 2000


def command_argv(command: str) -> list[str]:
    """``--train.agent_command``'s argv, checked: it parses and its program exists and is executable.
    Raises ValueError naming the flag (the driver calls this before any worker starts)."""
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise ValueError(
            f"--train.agent_command {command!r} does not parse as a command line: {exc}"
        ) from None
    if not argv:
        raise ValueError("--train.agent_command is empty")
    program = argv[0]
    if os.sep in program:
        if not os.path.isfile(program):
            raise ValueError(f"--train.agent_command {command!r}: {program} does not exist")
        if not os.access(program, os.X_OK):
            raise ValueError(
                f"--train.agent_command {command!r}: {program} is not executable (chmod +x it, or "
                f"name its interpreter first: python {program})"
            )
    elif shutil.which(program) is None:
        raise ValueError(f"--train.agent_command {command!r}: no program {program!r} on PATH")
    return argv


def parse_agent_output(stdout: str) -> Any:
    """The result on an agent program's last non-blank stdout line: a number (the reward, as a float), or a
    JSON object with ``reward`` (None: the run's reward source scores the sample) and optionally ``score``
    and ``extra_logs``. Raises ValueError saying what the last line was."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise ValueError("printed nothing on stdout; the last line must be the reward")
    last = lines[-1].strip()
    try:
        result = json.loads(last)
    except ValueError:
        result = None
    if isinstance(result, (int, float)) and not isinstance(result, bool):
        return float(result)
    if isinstance(result, dict) and "reward" in result:
        return result
    raise ValueError(f'printed {last[:200]!r} last; expected a number or a JSON object with "reward"')


class CommandAgentExecutor(OpenAIServerAgentExecutor):
    """Runs ``argv`` once per episode against the episode's endpoint (see the package README)."""

    def __init__(self, argv: list[str]):
        super().__init__()
        self.argv = list(argv)
        self._logged_kinds: set[str] = set()

    def agent_name(self) -> str:
        return f"--train.agent_command {shlex.join(self.argv)!r}"

    def _fail(self, kind: str, message: str, stderr: bytearray) -> EpisodeFailure:
        """The episode's failure; the first one of each kind is logged with the program's stderr tail."""
        tail = stderr.decode("utf-8", "replace")[-STDERR_TAIL:].rstrip()
        if kind not in self._logged_kinds:
            self._logged_kinds.add(kind)
            logger.error(
                "%s: %s (further such failures are counted in error/%s, not logged); its stderr ended "
                "with:\n%s",
                self.agent_name(),
                message,
                kind,
                tail or "(nothing)",
            )
        return EpisodeFailure(kind, f"{self.agent_name()} {message}")

    async def run_bounded(self, base_url: str, prompt: str, label: Any) -> Any:
        """Run the program for one episode and read its result (it bounds its own time, so that a program
        that runs too long is killed and its stderr logged)."""
        env = {
            **os.environ,
            "OPENAI_BASE_URL": base_url,
            "OPENAI_API_KEY": "rlhf",
            "RLHF_EPISODE_ID": base_url.rsplit("/", 2)[-2],
        }
        row = json.dumps({"prompt": prompt, "label": label}, default=str).encode() + b"\n"
        proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,  # its own process group, to kill
        )
        stdout, stderr = bytearray(), bytearray()  # what was read survives a timeout
        try:
            await asyncio.wait_for(
                asyncio.gather(
                    _feed(proc.stdin, row),
                    _drain(proc.stdout, stdout),
                    _drain(proc.stderr, stderr),
                    proc.wait(),
                ),
                self.env_step_timeout,
            )
        except BaseException as exc:  # timed out (a child may hold its pipes open), or abandoned
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the program and whatever it started
            await proc.wait()
            if isinstance(exc, asyncio.TimeoutError):
                raise self._fail(
                    "agent_timeout",
                    f"ran longer than --train.env_step_timeout {self.env_step_timeout:g} s and was killed",
                    stderr,
                ) from None
            raise
        if proc.returncode != 0:
            raise self._fail("agent_exit", f"exited with status {proc.returncode}", stderr)
        try:
            return parse_agent_output(stdout.decode("utf-8", "replace"))
        except ValueError as exc:
            raise self._fail("agent_output", str(exc), stderr) from None


async def _feed(stdin: asyncio.StreamWriter, data: bytes) -> None:
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # a program need not read its row
        stdin.write(data)
        await stdin.drain()
        stdin.close()


async def _drain(stream: asyncio.StreamReader, into: bytearray) -> None:
    while chunk := await stream.read(1 << 16):
        into += chunk
