"""What running the agent as a program (``--train.agent_command``) costs over an in-process agent.

One rollout step of ``--episodes`` episodes on a tiny Llama (HF engine, fp32), each episode two chat calls of
4 new tokens through the episode's OpenAI-compatible endpoint, by three contenders that send the same requests:

- ``in_process``: an ``OpenAIServerAgentExecutor`` subclass (aiohttp, in the rollout process);
- ``command_urllib``: ``--train.agent_command`` running a Python program that uses only the standard library;
- ``command_openai``: the same program written with the ``openai`` client (importing it dominates).

The contenders run in A B C order ``--rounds`` times in one process (one warm-up step first); the median wall
time of a step is kept. The difference over ``in_process``, divided by the episodes, is the per-episode cost
of a process (all episodes of a step run concurrently, so on more cores it overlaps more).

    .venv/bin/python bench/agent_command.py                # 16 episodes, 3 rounds
"""

from __future__ import annotations

import argparse
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
OPENAI = """
from openai import OpenAI
client = OpenAI()
def chat(messages):
    return client.chat.completions.create(model="policy", messages=messages, max_tokens=4).choices[0].message.content
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import aiohttp
    from transformers import AutoTokenizer

    from rlhf_agents import OpenAIServerAgentExecutor, RolloutWorker
    from rlhf_agents.plugin import build_executor
    from rlhf_core.config import RLConfig
    from rlhf_core.rollout.async_engine import AsyncEngine
    from rlhf_core.rollout.hf_engine import HFEngine
    from rlhf_core.testing.tiny import make_tiny_llama
    from rlhf_core.types import SamplingParams

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

    tmp = Path(tempfile.mkdtemp())
    model = make_tiny_llama(tmp / "model")
    tokenizer = AutoTokenizer.from_pretrained(model)
    engine = AsyncEngine(HFEngine(model, dtype="float32"))
    cfg = RLConfig()
    cfg.data.max_len = 64
    executors = {"in_process": InProcess()}
    for name, client in (("command_urllib", URLLIB), ("command_openai", OPENAI)):
        path = tmp / f"{name}.py"
        path.write_text(PROGRAM.format(client=client))
        cfg.train.agent_command = shlex.join([sys.executable, str(path)])
        executors[name] = build_executor(cfg)
    workers = {name: RolloutWorker(engine, tokenizer, ex, None, cfg) for name, ex in executors.items()}
    rows = [{"prompt_text": f"w{i} w{i + 1}", "prompt_uid": i} for i in range(args.episodes)]
    params = SamplingParams(max_new_tokens=4)
    times: dict[str, list[float]] = {name: [] for name in workers}
    for step in range(args.rounds + 1):
        for name, worker in workers.items():
            start = time.perf_counter()
            trajs = worker.rollout(rows, params, step=step)
            elapsed = time.perf_counter() - start
            assert all(t.error is None for t in trajs), [t.error for t in trajs if t.error][:1]
            if step:  # step 0 warms up
                times[name].append(elapsed)
    for worker in workers.values():
        worker.close()
    base = statistics.median(times["in_process"])
    print(f"{args.episodes} episodes x 2 calls, median of {args.rounds} rounds:")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(
            f"  {name:15s} {med:6.2f} s/step  {med / base:5.2f}x in_process  "
            f"+{(med - base) / args.episodes * 1000:6.0f} ms/episode"
        )


if __name__ == "__main__":
    main()
