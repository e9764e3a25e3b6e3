"""An agent written in another language than Python, with no rlhf code: a Node script (plain ``fetch``) run per
episode by ``--train.agent_command`` in a GRPO run. It streams its first call with log-probs and tools, runs the
calculator call the model makes, and stops its second call on a string. The policy is
``examples/agent_tool_grpo.py``'s warm start (calls the calculator or answers at once, about evenly)."""

import json
import shutil
from pathlib import Path

import pytest

from rlhf_agents.loading import load_module

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

AGENT = r"""
const row = JSON.parse(require("fs").readFileSync(0, "utf8"));
const base = process.env.OPENAI_BASE_URL;
const tools = TOOLS_JSON;
async function post(body) {
  const resp = await fetch(base + "/chat/completions", {
    method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body),
  });
  if (!resp.ok) throw new Error(resp.status + " " + (await resp.text()));
  return resp;
}
(async () => {
  const messages = [{role: "user", content: row.prompt}];
  const resp = await post({model: "policy", messages, tools, stream: true, logprobs: true,
                           stream_options: {include_usage: true}});
  const events = (await resp.text()).split("\n").filter(l => l.startsWith("data: ")).map(l => l.slice(6));
  if (events.pop() !== "[DONE]") throw new Error("no [DONE]");
  const chunks = events.map(e => JSON.parse(e));
  let content = "", logprobs = 0, usage = null;
  const calls = [];
  for (const c of chunks) {
    if (c.usage) usage = c.usage;
    for (const choice of c.choices) {
      content += choice.delta.content || "";
      for (const call of choice.delta.tool_calls || []) calls.push(call);
      logprobs += choice.logprobs ? choice.logprobs.content.length : 0;
    }
  }
  let stopped = 0;
  if (calls.length) {
    const [a, b] = JSON.parse(calls[0].function.arguments).expression.split("*").map(Number);
    messages.push({role: "assistant", content: null, tool_calls: calls.map(({index, ...c}) => c)});
    messages.push({role: "tool", tool_call_id: calls[0].id, content: String(a * b)});
    const second = await (await post({model: "policy", messages, tools, stop: ["="]})).json();
    const choice = second.choices[0];
    stopped = choice.finish_reason === "stop" && !choice.message.content.includes("=") ? 1 : 0;
  }
  console.log(JSON.stringify({reward: calls.length ? 1 : 0, extra_logs: {
    stream_chunks: chunks.length, logprob_tokens: logprobs, usage_tokens: usage.completion_tokens, stopped}}));
})().catch(e => { console.error(e); process.exit(1); });
"""


@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_a_node_agent_streams_stops_reads_logprobs_and_calls_tools_in_a_grpo_run(tmp_path, smollm2):
    from rlhf_cli import train

    example = load_module(str(EXAMPLES / "agent_tool_grpo.py"), "agent_tool_grpo")
    tools = load_module(str(EXAMPLES / "agent_tool_calculator.py"), "agent_tool_calculator").TOOLS
    question = [(48, 23)]
    example.warm_start(tmp_path / "policy", question, guessed=question)
    agent = tmp_path / "agent.js"
    agent.write_text(AGENT.replace("TOOLS_JSON", json.dumps(tools)))
    result = train(
        "ppo",
        dataset=[{"input": "What is 48 * 23?", "label": "1104"}],
        actor={"model_name_or_path": str(tmp_path / "policy"), "adam": {"lr": 5e-4}, "lr_warmup_ratio": 0},
        algo={"advantage": {"estimator": "group_norm"}, "kl": {"init_coef": 0}},
        rollout={"batch_size": 1, "n_samples_per_prompt": 8, "max_new_tokens": 48},
        train={
            "batch_size": 8,
            "micro_batch_size": 8,
            "max_steps": 2,
            "num_episodes": 2,
            "agent_command": f"node {agent}",
            "seed": 0,
        },
        data={"max_len": 512, "label_key": "label"},
        ds={"param_dtype": "fp32"},
        ckpt={"output_dir": str(tmp_path / "run")},
    )
    rows = result.metrics
    assert len(rows) == 2
    for row in rows:
        assert row["reward/unscorable"] == 0, row
        assert row["stream_chunks"] >= 4 and row["logprob_tokens"] == row["usage_tokens"] > 0
        # every episode that called the calculator stopped its answer at "=" (the memorised "48 * 23 = 1104")
        assert row["stopped"] == row["reward/mean"]
    assert sum(row["reward/mean"] for row in rows) > 0  # some episodes called the tool
