"""GRPO teaches a policy to use a calculator through the OpenAI tools API: one command, a learning curve.

    python examples/agent_tool_grpo.py [OUTPUT_DIR] [--steps 8] [--lr 5e-4] [--seed 0]

The agent is ``examples/agent_tool_calculator.py``: the real ``openai`` client offers the model a calculator,
runs the tool calls the model makes and sends their results back as ``role: "tool"`` messages; reward 1 when
the calculator was called and the last reply's last number is the product, else 0.

The policy is a tiny Llama (2 layers, hidden 64) with SmolLM2-135M-Instruct's tokenizer and chat template,
first taught by plain next-token training (``warm_start``) two ways to answer each multiplication question:
call the calculator and then give its result, or answer at once with a wrong product. It starts out calling
the tool on about half of its samples; GRPO (``rlhf train ppo`` through the Python API, in this one process,
no Ray) moves it to the tool. SmolLM2-135M-Instruct itself is not the policy: it never emitted a
``<tool_call>`` in 48 samples at temperature 1, so RL would have nothing to reinforce. The tokenizer comes
from the SmolLM2 model that ``python -m rlhf_core.testing.smollm2`` builds (cached).
"""

import argparse
import json
import shutil
from pathlib import Path

import torch

from rlhf_agents.loading import load_module
from rlhf_agents.openai_server import hermes_tools_block
from rlhf_core.testing.smollm2 import smollm2_dir

AGENT = Path(__file__).resolve().parent / "agent_tool_calculator.py"
QUESTIONS = [(37, 12), (48, 23), (19, 64), (75, 31)]


def warm_start(path: Path, questions, guessed, seed: int = 0):
    """Write a tiny policy to ``path`` that answers each ``(a, b)`` of ``questions`` with the calculator call
    and then the product, and each of ``guessed`` also at once with a wrong product (so its first reply token
    chooses between the two, about evenly). Every other reply token is trained until its probability is above
    0.98, then sharpened to above 0.999 by doubling the LM head's weights (that at least squares each token's odds
    against the rest; an even choice stays about even): a sampled episode seldom breaks a memorised token.
    Returns the model, the tokenizer and the conversations' token ids."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_dir() / name, path / name)
    tok = AutoTokenizer.from_pretrained(str(path))
    tools = load_module(str(AGENT), "agent_tool_calculator").TOOLS

    def enc(text):
        return tok.encode(text, add_special_tokens=False)

    rows, replies, chosen = (
        [],
        [],
        [],
    )  # token ids, the (start, end) spans of the replies, sampled first token?
    for a, b in questions:
        # what the endpoint renders: SmolLM2's template ignores `tools`, so the endpoint adds a Hermes block
        turns = [
            {"role": "system", "content": hermes_tools_block(tools)},
            {"role": "user", "content": f"What is {a} * {b}?"},
        ]
        first = enc(tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True))
        call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a} * {b}"}})
        call = enc(f"<tool_call>\n{call}\n</tool_call>") + [tok.eos_token_id]
        turns += [
            {"role": "assistant", "content": tok.decode(call[:-1])},
            {"role": "tool", "content": str(a * b)},
        ]
        second = enc(tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True))
        answer = enc(f"{a} * {b} = {a * b}") + [tok.eos_token_id]
        rows.append(second + answer)
        replies.append([(len(first), len(first) + len(call)), (len(second), len(second) + len(answer))])
        chosen.append((a, b) in guessed)
        if (a, b) in guessed:
            guess = enc(f"{a} * {b} = {a * b + 10}") + [tok.eos_token_id]
            rows.append(first + guess)
            replies.append([(len(first), len(first) + len(guess))])
            chosen.append(True)

    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tok.eos_token_id)
    attention = torch.zeros_like(ids)
    target = torch.zeros_like(ids, dtype=torch.bool)  # the tokens the model writes
    choice = torch.zeros_like(
        ids, dtype=torch.bool
    )  # first reply tokens of guessed questions: left to sampling
    for k, (row, spans) in enumerate(zip(rows, replies)):
        ids[k, : len(row)] = torch.tensor(row)
        attention[k, : len(row)] = 1
        for start, end in spans:
            target[k, start:end] = True
        choice[k, spans[0][0]] = chosen[k]
    predicts = target[:, 1:]  # position t predicts token t + 1: only those positions need the 49k-word head
    labels, at_choice = ids[:, 1:][predicts], choice[:, 1:][predicts]

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    opt = torch.optim.Adam(
        model.parameters(), lr=1e-2, fused=True
    )  # fused: its update takes 12 ms here, unfused 80
    for _ in range(1000):
        hidden = model.model(ids, attention_mask=attention).last_hidden_state[:, :-1][predicts]
        nll = torch.nn.functional.cross_entropy(model.lm_head(hidden), labels, reduction="none")
        if nll[~at_choice].max() < 0.02:
            break
        opt.zero_grad()
        nll.mean().backward()
        opt.step()
    else:
        raise RuntimeError(
            f"warm start (seed {seed}): a reply token's probability is still "
            f"{float((-nll[~at_choice].max()).exp()):.3f} after 1000 steps"
        )
    with torch.no_grad():
        model.lm_head.weight *= 2
    model.save_pretrained(str(path))
    return model.eval(), tok, rows


def learn(
    policy: Path, out: Path, questions, steps: int = 8, lr: float = 5e-4, seed: int = 0, samples: int = 16
) -> list[dict]:
    """``steps`` GRPO steps from ``policy``, each on every question with ``samples`` episodes of the agent;
    the run directory is ``out``. Returns the run's metrics, one dict per step."""
    from rlhf_cli import train  # here, not above: warm_start needs only rlhf-agents and transformers

    result = train(
        "ppo",
        dataset=[{"input": f"What is {a} * {b}?", "label": str(a * b)} for a, b in questions],
        actor={"model_name_or_path": str(policy), "adam": {"lr": lr}, "lr_warmup_ratio": 0},
        algo={"advantage": {"estimator": "group_norm"}, "kl": {"init_coef": 0}},  # GRPO
        rollout={"batch_size": len(questions), "n_samples_per_prompt": samples, "max_new_tokens": 48},
        train={
            "batch_size": len(questions) * samples,
            "micro_batch_size": len(questions) * samples,
            "max_steps": steps,
            "num_episodes": steps,
            "agent_func_path": str(AGENT),
            "seed": seed,
        },
        data={"max_len": 512, "label_key": "label"},
        ds={"param_dtype": "fp32"},
        ckpt={"output_dir": str(out)},
    )
    return result.metrics


def main(out: Path, steps: int = 8, lr: float = 5e-4, seed: int = 0) -> list[dict]:
    shutil.rmtree(out, ignore_errors=True)
    warm_start(out / "policy", QUESTIONS, QUESTIONS, seed)
    metrics = learn(out / "policy", out / "run", QUESTIONS, steps, lr, seed)
    for row in metrics:
        print(
            f"step {row['step']:2d}: reward {row['reward/mean']:.3f}, calculator calls per episode "
            f"{row['tool_calls']:.3f}"
        )
    return metrics


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=Path("runs/agent_tool_grpo"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    main(args.out, args.steps, args.lr, args.seed)
