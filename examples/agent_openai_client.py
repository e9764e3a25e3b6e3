"""An agent written against an OpenAI-compatible chat API, for
``--train.agent_func_path examples/agent_openai_client.py``.

rlhf serves each episode a local endpoint backed by the policy being trained and records the tokens of
every call, so this ordinary client code yields a token-level trajectory. The agent asks the question,
then asks the model to check its work, and rewards a final answer equal to the label.

It uses the ``openai`` package when it is installed, else plain HTTP with aiohttp.
"""

import re

import aiohttp

from rlhf_agents import OpenAIServerAgentExecutor

try:
    from openai import AsyncOpenAI
except ImportError:
    AsyncOpenAI = None

MAX_TOKENS = 16


async def chat(base_url, messages):
    """One chat completion; returns the assistant's reply."""
    if AsyncOpenAI is not None:
        async with AsyncOpenAI(
            base_url=base_url, api_key="unused"
        ) as client:  # closed: no dangling connections
            reply = await client.chat.completions.create(
                model="policy", messages=messages, max_tokens=MAX_TOKENS
            )
        return reply.choices[0].message.content
    async with aiohttp.ClientSession() as session:
        body = {"model": "policy", "messages": messages, "max_tokens": MAX_TOKENS}
        async with session.post(f"{base_url}/chat/completions", json=body) as resp:
            resp.raise_for_status()
            reply = await resp.json()
    return reply["choices"][0]["message"]["content"]


def last_number(text):
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text)
    return float(numbers[-1]) if numbers else None


class AgentExecutor(OpenAIServerAgentExecutor):
    async def run_agent(self, base_url, prompt, label):
        messages = [{"role": "user", "content": prompt}]
        first = await chat(base_url, messages)
        messages += [
            {"role": "assistant", "content": first},
            {"role": "user", "content": "check your work . what is the final answer ?"},
        ]
        final = await chat(base_url, messages)
        answer = last_number(final)
        return {
            "reward": 1.0 if answer is not None and answer == float(label) else 0.0,
            "extra_logs": {"answered": 0.0 if answer is None else 1.0},
        }
