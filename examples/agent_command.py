#!/usr/bin/env python3
"""An agent that is a program, for ``--train.agent_command "python examples/agent_command.py"``.

rlhf runs it once per episode. It reads the prompt row from stdin (``{"prompt": ..., "label": ...}``), talks
to the policy through the OpenAI-compatible endpoint in ``$OPENAI_BASE_URL`` (the ``openai`` client reads
it, and ``$OPENAI_API_KEY``, from the environment), and prints its reward as the last line of stdout. Any
language works the same way; this one uses the ``openai`` package. Logs go to stderr.

The agent asks the question, then asks the model to check its work, and rewards a final answer equal to the
label.
"""

import json
import re
import sys

from openai import OpenAI

MAX_TOKENS = 16


def last_number(text):
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text or "")
    return float(numbers[-1]) if numbers else None


def main():
    row = json.load(sys.stdin)
    client = OpenAI()  # base URL and key from the environment
    messages = [{"role": "user", "content": row["prompt"]}]
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=MAX_TOKENS)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "check your work . what is the final answer ?"},
    ]
    final = client.chat.completions.create(model="policy", messages=messages, max_tokens=MAX_TOKENS)
    answer = last_number(final.choices[0].message.content)
    print(f"answer: {answer}", file=sys.stderr)
    correct = answer is not None and row["label"] is not None and answer == float(row["label"])
    print(
        json.dumps({"reward": 1.0 if correct else 0.0, "extra_logs": {"answered": float(answer is not None)}})
    )


if __name__ == "__main__":
    main()
