"""Agents that are programs (``--train.agent_command``): a process per episode, talking to the episode's
OpenAI-compatible endpoint, printing its reward. The programs here are real processes."""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import sys
import time

import pytest

from rlhf_agents import RolloutWorker
from rlhf_agents.plugin import executor_class
from rlhf_agents.worker import RolloutFailureError
from rlhf_core.config_parser import ConfigError
from rlhf_core.types import SamplingParams


def command(*argv) -> str:
    return shlex.join([sys.executable, *map(str, argv)])


def test_the_example_program_yields_a_token_trajectory_and_its_reward(
    async_engine, tokenizer, cfg_factory, check_tokens, examples_dir
):
    """examples/agent_command.py, run as a command, drives two chat calls with the ``openai`` client; its
    episode is one token-exact trajectory, and its printed reward is the episode's."""
    pytest.importorskip("openai")
    cfg = cfg_factory(
        train={"agent_command": command(examples_dir / "agent_command.py")}, data={"max_len": 96}
    )
    worker = RolloutWorker.from_config(cfg, async_engine, tokenizer)
    prompts = [
        {"prompt_text": "w5 w6 w7", "label": "3", "prompt_uid": 0}
    ]  # one process: importing openai costs ~1.5 s
    trajs = worker.rollout(prompts, SamplingParams(n=1, max_new_tokens=8), step=0)
    worker.close()
    for t in trajs:
        assert t.error is None, t.error
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": t.prompt_text}], tokenize=False, add_generation_prompt=True
        )
        assert t.prompt_ids == tokenizer.encode(rendered, add_special_tokens=False)
        check_tokens(t)
        mask = t.action_mask
        starts = [k for k in range(len(mask)) if mask[k] == 1 and (k == 0 or mask[k - 1] == 0)]
        assert len(starts) == 2 and t.extra_logs["num_turns"] == 2.0  # the program's two calls
        final = tokenizer.decode(t.response_ids[starts[1] :], skip_special_tokens=True)
        numbers = [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?", final)]
        answered = bool(numbers)
        assert t.reward == (1.0 if answered and numbers[-1] == float(t.label) else 0.0)
        assert t.extra_logs["answered"] == float(answered)


FLAKY_AGENT = r"""
import json, os, subprocess, sys, time, urllib.request
row = json.load(sys.stdin)
kind = row["label"]
def chat():
    body = json.dumps({"messages": [{"role": "user", "content": row["prompt"]}], "max_tokens": 2}).encode()
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", body,
                                 {"Content-Type": "application/json", "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
    return json.load(urllib.request.urlopen(req))["choices"][0]["message"]["content"]
chat()
if kind == "ok":
    print("thinking out loud")
    print(json.dumps({"reward": 0.25, "score": 1.0}))
elif kind == "exit":
    print("boom: the tool crashed", file=sys.stderr)
    sys.exit(3)
elif kind == "hang":
    child = subprocess.Popen(["sleep", "60"])  # in the program's process group: killed with it
    open(sys.argv[1], "w").write(str(child.pid))
    print("hanging", file=sys.stderr, flush=True)
    time.sleep(60)
else:
    print("the answer is probably 4")
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead, waiting to be reaped
    except FileNotFoundError:
        return False


def test_failing_programs_are_counted_logged_once_and_killed_at_the_timeout(
    tmp_path, async_engine, tokenizer, cfg_factory, caplog
):
    agent = tmp_path / "flaky.py"
    agent.write_text(FLAKY_AGENT)
    pid_file = tmp_path / "child.pid"
    cfg = cfg_factory(
        train={"agent_command": command(agent, pid_file), "env_step_timeout": 6.0},
        reward={"max_failure_fraction": 1.0},
    )
    worker = RolloutWorker.from_config(cfg, async_engine, tokenizer)
    rows = [
        {"prompt_text": "w5", "label": kind, "prompt_uid": i}
        for i, kind in enumerate(["ok", "exit", "hang", "talk"])
    ]
    start = time.perf_counter()
    with caplog.at_level(logging.ERROR, logger="rlhf_agents.command_agent"):
        ok, crashed, hung, talked = worker.rollout(rows, SamplingParams(max_new_tokens=2), step=0)
    assert time.perf_counter() - start < 30  # not the 60 s the program wanted
    assert (ok.reward, ok.score, ok.error) == (0.25, 1.0, None) and ok.extra_logs["num_turns"] == 1.0
    assert crashed.reward is None and "exited with status 3" in crashed.error
    assert hung.reward is None and "longer than --train.env_step_timeout 6 s" in hung.error
    assert talked.reward is None and "'the answer is probably 4'" in talked.error
    for t in (crashed, hung, talked):  # the tokens of the call the program made are kept
        assert t.error.startswith(f"--train.agent_command {cfg.train.agent_command!r}")
        assert sum(t.action_mask) >= 1
    m = worker.last_metrics
    assert (m["error/agent_exit"], m["error/agent_timeout"], m["error/agent_output"]) == (1.0, 1.0, 1.0)
    assert m["reward/unscorable"] == 3.0
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child), "the hung program's child survived: the process group was not killed"
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 3 and any("boom: the tool crashed" in x for x in logged)  # with the stderr tail
    assert any("hanging" in x for x in logged)

    # the same failures again are counted, not logged again; and above the limit the run stops naming the command
    caplog.clear()
    worker.max_failure_fraction = 0.5
    with caplog.at_level(logging.ERROR, logger="rlhf_agents.command_agent"):
        with pytest.raises(RolloutFailureError, match=r"3 of 4 samples .*agent command: "):
            worker.rollout(
                [dict(rows[0], label=kind) for kind in ("ok", "exit", "talk", "exit")],
                SamplingParams(max_new_tokens=2),
                step=1,
            )
    assert caplog.records == []
    worker.close()


def test_the_command_is_checked_before_any_worker_starts(tmp_path, cfg_factory):
    def check(cmd, **train):
        return executor_class(cfg_factory(train={"agent_command": cmd, **train}))

    cls, (argv,) = check(command(tmp_path / "agent.py"))  # the interpreter exists; its script is its business
    assert cls.__name__ == "CommandAgentExecutor" and argv == [sys.executable, str(tmp_path / "agent.py")]
    with pytest.raises(ConfigError, match=r"--train.agent_command .*no program 'no-such-agent-xyz' on PATH"):
        check("no-such-agent-xyz --fast")
    script = tmp_path / "agent.sh"
    script.write_text("#!/bin/sh\necho 1\n")
    with pytest.raises(ConfigError, match=r"agent.sh is not executable"):
        check(str(script))
    os.chmod(script, 0o755)
    assert check(str(script))[1] == ([str(script)],)
    with pytest.raises(ConfigError, match=r"--train.agent_command .*does not parse"):
        check("python 'unclosed")
    with pytest.raises(
        ConfigError, match=r"--train.agent_command is the agent; drop --train.agent_func_path"
    ):
        check(str(script), agent_func_path="agent.py")
    with pytest.raises(
        ConfigError, match=r"--train.per_call_samples 'sometimes': choose one of auto, always, never"
    ):
        check(str(script), per_call_samples="sometimes")
    with pytest.raises(
        ConfigError, match=r"--train.per_call_samples never applies to agents on the OpenAI endpoint"
    ):
        executor_class(cfg_factory(train={"per_call_samples": "never"}))


def test_parse_agent_output():
    from rlhf_agents.command_agent import parse_agent_output

    assert parse_agent_output("log line\n 0.5 \n\n") == 0.5
    assert parse_agent_output('{"reward": 1, "extra_logs": {"x": 2}}\n') == {
        "reward": 1,
        "extra_logs": {"x": 2},
    }
    assert parse_agent_output('{"reward": null}') == {"reward": None}  # the reward source scores it
    for bad in ("", "\n \n", "true", '{"score": 1}', "[1]", "0.5 points"):
        with pytest.raises(ValueError):
            parse_agent_output(bad)


def test_a_long_lived_agent_service_through_a_forwarding_command(async_engine, tokenizer, cfg_factory):
    """The README's recipe for an agent service: ``bash -c 'curl ...'`` forwards the row (stdin) and the episode's
    endpoint (a header) to the service, whose answer is the program's stdout. The service is a thread here."""
    import threading
    import urllib.request
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    seen = []

    class AgentService(BaseHTTPRequestHandler):
        def do_POST(self):
            row = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            body = json.dumps(
                {"messages": [{"role": "user", "content": row["prompt"]}], "max_tokens": 2}
            ).encode()
            request = urllib.request.Request(
                self.headers["X-Base-URL"] + "/chat/completions", body, {"Content-Type": "application/json"}
            )
            reply = json.load(urllib.request.urlopen(request))["choices"][0]["message"]["content"]
            seen.append((row, reply))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(json.dumps({"reward": len(reply.split()) / 10}).encode() + b"\n")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), AgentService)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    forward = (
        f"""bash -c 'curl -sf -H "X-Base-URL: $OPENAI_BASE_URL" --data-binary @- """
        f"""http://127.0.0.1:{server.server_address[1]}/run'"""
    )
    try:
        cfg = cfg_factory(train={"agent_command": forward})
        worker = RolloutWorker.from_config(cfg, async_engine, tokenizer)
        (t,) = worker.rollout(
            [{"prompt_text": "w5 w6", "label": "7", "prompt_uid": 0}],
            SamplingParams(max_new_tokens=2),
            step=0,
        )
        worker.close()
    finally:
        server.shutdown()
    ((row, reply),) = seen
    assert row == {"prompt": "w5 w6", "label": "7"} and t.error is None
    assert t.reward == len(reply.split()) / 10 and sum(t.action_mask) >= 1
