"""Agent episodes per second, and what running the agent as a program (``--train.agent_command``) costs over an
in-process agent.

One rollout step of ``--episodes`` episodes (HF engine, fp32; ``--model smollm2``: SmolLM2-135M-Instruct, its
ChatML template; ``tiny``: a tiny Llama), each episode two chat calls of 4 new tokens through the episode's
OpenAI-compatible endpoint, by contenders that send the same requests:

- ``in_process``: an ``OpenAIServerAgentExecutor`` subclass (aiohttp, in the rollout process);
- ``command_urllib``: ``--train.agent_command`` running a Python program that uses only the standard library;
- ``command_stream``: the same program asking for ``stream: true`` and reading the server-sent events;
- ``command_openai``: the program written with the ``openai`` client (importing it dominates; ``--openai``).

The contenders run in A B C order ``--rounds`` times in one process (one warm-up step first); the median wall
time of a step and its CPU time (this process, all threads, plus the agent programs it waited for) are kept.
Episodes per second are the episodes over the median wall time; the difference over ``in_process``, divided by
the episodes, is the per-episode cost of a process (all episodes of a step run concurrently).

The endpoint's overhead per call: ``in_process`` once more against an engine that answers at once with 4
fixed tokens (no model), so all that is left is the endpoint (HTTP, validation, the chat template,
tokenizing, the token trace, the JSON answer) and the agent's client; wall and CPU ms per call.

    .venv/bin/python bench/agent_command.py                  # SmolLM2, 16 episodes, 3 rounds
    .venv/bin/python bench/agent_command.py --model tiny --openai
"""

from __future__ import annotations

import argparse
import resource
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

PROGRAM = """
import json, os, sys
row = json.load(sys.stdin)
{client}
messages = [{{"role": "user", "content": row["prompt"]}}]
for _ in range(2):
    reply = chat(messages)
    messages += [{{"role": "assistant", "content": reply}}, {{"role": "user", "content": "w1"}}]
print(1.0)
"""
URLLIB = """
import urllib.request
def chat(messages):
    body = json.dumps({"messages": messages, "max_tokens": 4}).encode()
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", body, {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req))["choices"][0]["message"]["content"]
"""
STREAM = """
import urllib.request
def chat(messages):
    body = json.dumps({"messages": messages, "max_tokens": 4, "stream": True}).encode()
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", body, {"Content-Type": "application/json"})
    text = ""
    for line in urllib.request.urlopen(req):
        data = line.decode().strip().removeprefix("data: ")
        if data and data != "[DONE]" and line.startswith(b"data: "):
            text += json.loads(data)["choices"][0]["delta"].get("content") or ""
    return text
"""
OPENAI = """
from openai import OpenAI
client = OpenAI()
def chat(messages):
    return client.chat.completions.create(model="policy", messages=messages, max_tokens=4).choices[0].message.content
"""


def cpu_seconds() -> float:
    """CPU seconds of this process (every thread) and of the children it has waited for (the programs)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument(
        "--openai", action="store_true", help="also the program written with the openai client"
    )
    args = parser.parse_args()

    import aiohttp
    from transformers import AutoTokenizer

    from rlhf_agents import OpenAIServerAgentExecutor, RolloutWorker
    from rlhf_agents.plugin import build_executor
    from rlhf_core.config import RLConfig
    from rlhf_core.rollout.async_engine import AsyncEngine
    from rlhf_core.rollout.hf_engine import HFEngine
    from rlhf_core.testing.smollm2 import smollm2_dir
    from rlhf_core.testing.tiny import make_tiny_llama
    from rlhf_core.types import GenerationOutput, SamplingParams

    class InProcess(OpenAIServerAgentExecutor):
        async def run_agent(self, base_url, prompt, label):
            messages = [{"role": "user", "content": prompt}]
            async with aiohttp.ClientSession() as http:
                for _ in range(2):
                    body = {"messages": messages, "max_tokens": 4}
                    async with http.post(f"{base_url}/chat/completions", json=body) as resp:
                        reply = (await resp.json())["choices"][0]["message"]["content"]
                    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "w1"}]
            return 1.0

    class Instant:
        """An engine that answers every request at once with the same 4 tokens: the endpoint alone is timed."""

        def __init__(self, ids):
            self.ids = ids

        async def generate(self, request):
            return [GenerationOutput(list(self.ids), [0.0] * len(self.ids), "length")]

    tmp = Path(tempfile.mkdtemp())
    model = str(smollm2_dir()) if args.model == "smollm2" else make_tiny_llama(tmp / "model")
    tokenizer = AutoTokenizer.from_pretrained(model)
    engine = AsyncEngine(HFEngine(model, dtype="float32"))
    cfg = RLConfig()
    cfg.data.max_len = 256
    executors = {"in_process": InProcess()}
    programs = {"command_urllib": URLLIB, "command_stream": STREAM} | (
        {"command_openai": OPENAI} if args.openai else {}
    )
    for name, client in programs.items():
        path = tmp / f"{name}.py"
        path.write_text(PROGRAM.format(client=client))
        cfg.train.agent_command = shlex.join([sys.executable, str(path)])
        executors[name] = build_executor(cfg)
    workers = {name: RolloutWorker(engine, tokenizer, ex, None, cfg) for name, ex in executors.items()}
    instant_ids = tokenizer.encode(" w1 w2", add_special_tokens=False)[:4]
    workers["endpoint_only"] = RolloutWorker(Instant(instant_ids), tokenizer, InProcess(), None, cfg)
    rows = [{"prompt_text": f"Say w{i} w{i + 1}", "prompt_uid": i} for i in range(args.episodes)]
    params = SamplingParams(max_new_tokens=4)
    walls: dict[str, list[float]] = {name: [] for name in workers}
    cpus: dict[str, list[float]] = {name: [] for name in workers}
    for step in range(args.rounds + 1):
        for name, worker in workers.items():
            start, cpu = time.perf_counter(), cpu_seconds()
            trajs = worker.rollout(rows, params, step=step)
            elapsed, cpu = time.perf_counter() - start, cpu_seconds() - cpu
            assert all(t.error is None for t in trajs), [t.error for t in trajs if t.error][:1]
            if step:  # step 0 warms up
                walls[name].append(elapsed)
                cpus[name].append(cpu)
    for worker in workers.values():
        worker.close()
    base = statistics.median(walls["in_process"])
    print(f"{args.model}: {args.episodes} episodes x 2 calls of 4 tokens, median of {args.rounds} rounds:")
    for name in executors:
        wall, cpu = statistics.median(walls[name]), statistics.median(cpus[name])
        print(
            f"  {name:15s} {args.episodes / wall:6.1f} episodes/s  {wall:6.2f} s/step  {cpu:6.2f} CPU s/step  "
            f"+{(wall - base) / args.episodes * 1000:5.0f} ms/episode over in_process"
        )
    calls = 2 * args.episodes
    wall, cpu = statistics.median(walls["endpoint_only"]), statistics.median(cpus["endpoint_only"])
    print(
        f"  endpoint alone (an engine that answers at once): {wall / calls * 1000:.1f} ms/call wall, "
        f"{cpu / calls * 1000:.1f} ms/call CPU (endpoint and the agent's aiohttp client, one process)"
    )


if __name__ == "__main__":
    main()
