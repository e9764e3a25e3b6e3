"""A tool-using agent written against the OpenAI tools API, for ``--train.agent_func_path``.

The model is offered one tool, a calculator. When its reply calls the tool, the agent evaluates the
expression and sends the result back as a ``role: "tool"`` message, up to ``MAX_CALLS`` model calls; the
last reply is the answer. Reward: 1 when the calculator was called and the answer's last number equals the
label, else 0 (the example teaches tool use; drop the first condition to reward any correct answer).

rlhf's endpoint turns the model's ``<tool_call>{json}</tool_call>`` replies into ``tool_calls`` and renders
an assistant message sent back with them as the model's original text, so the whole episode is one
token-exact trajectory, whatever the chat template does with tool calls.
"""

import ast
import json
import operator
import re

from openai import AsyncOpenAI

from rlhf_agents import OpenAIServerAgentExecutor

MAX_TOKENS = 48
MAX_CALLS = 3
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> float:
    """The value of an arithmetic expression (numbers, + - * /, unary minus, parentheses); ValueError else."""

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"not arithmetic: {ast.dump(node)}")

    try:
        return value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ZeroDivisionError) as exc:
        raise ValueError(str(exc)) from None


def tool_result(call) -> str:
    """What the calculator answers to one tool call (an error text for a bad call, as a real tool would)."""
    if call.function.name != "calculator":
        return f"error: unknown tool {call.function.name!r}"
    try:
        result = calculate(str(json.loads(call.function.arguments)["expression"]))
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}"
    return f"{result:g}"


def last_number(text):
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text or "")
    return float(numbers[-1]) if numbers else None


class AgentExecutor(OpenAIServerAgentExecutor):
    async def run_agent(self, base_url, prompt, label):
        messages = [{"role": "user", "content": prompt}]
        tool_calls = 0
        async with AsyncOpenAI(base_url=base_url, api_key="unused") as client:
            for _ in range(MAX_CALLS):
                reply = await client.chat.completions.create(
                    model="policy", messages=messages, tools=TOOLS, max_tokens=MAX_TOKENS
                )
                message = reply.choices[0].message
                messages.append(message)
                if not message.tool_calls:
                    break
                for call in message.tool_calls:
                    tool_calls += 1
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": tool_result(call)})
        answer = last_number(message.content)
        return {
            "reward": 1.0 if tool_calls and answer is not None and answer == float(label) else 0.0,
            "extra_logs": {"tool_calls": float(tool_calls)},
        }
