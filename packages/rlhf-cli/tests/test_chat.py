"""rlhf chat, scripted through stdin: replies, history, /reset, streaming, and refused settings.

The expected replies come from a second computation: the HF rollout engine decoding greedily from the
conversation rendered by hand with the tokenizer's chat template.
"""

import io
import subprocess
import sys

import pytest

from rlhf_cli import chat
from rlhf_core.config_parser import parse_config


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from rlhf_core.testing.tiny import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("chat") / "model", num_words=30)


def greedy_reply(model_dir, messages, max_new_tokens=4):
    from transformers import AutoTokenizer

    from rlhf_core.rollout.hf_engine import HFEngine
    from rlhf_core.types import GenerationRequest, SamplingParams

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    ((out,),) = HFEngine(model_dir, dtype="fp32").generate(
        [GenerationRequest(ids, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens))]
    )
    return tok.decode(out.token_ids, skip_special_tokens=True)


FLAGS = [
    "--apply_chat_template",
    "--greedy_sampling",
    "--repetition_penalty",
    "1.0",
    "--max_new_tokens",
    "4",
    "--param_dtype",
    "fp32",
]


def run_chat(model_dir, stdin, *flags):
    """The real command, stdin piped."""
    cmd = [sys.executable, "-m", "rlhf_cli.main", "chat", "--pretrain", model_dir, *FLAGS, *flags]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=300)


def chat_in_process(model_dir, stdin, *flags, stream=False):
    """The command's loop in this process (no interpreter start-up); returns (stdout, stderr)."""
    cfg, _ = parse_config("chat", ["--pretrain", model_dir, *FLAGS, *flags])
    chat.check(cfg)
    tokenizer, model = chat.load(cfg)
    out, err = io.StringIO(), io.StringIO()
    assert chat.chat_loop(cfg, tokenizer, model, io.StringIO(stdin), out, err, stream, interactive=False) == 0
    return out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def replies(model):
    first = greedy_reply(model, [{"role": "user", "content": "w1 w2"}])
    second = greedy_reply(
        model,
        [
            {"role": "user", "content": "w1 w2"},
            {"role": "assistant", "content": first},
            {"role": "user", "content": "w3"},
        ],
    )
    # the history changes the answer here, so a chat that forgot it would be caught
    assert second != greedy_reply(model, [{"role": "user", "content": "w3"}])
    return first.strip(), second.strip()


def test_a_scripted_chat_keeps_history_until_reset(model, replies):
    done = run_chat(model, "w1 w2\nw3\n/reset\nw1 w2\n")
    assert done.returncode == 0, done.stderr
    first, second = replies
    assert done.stdout.splitlines() == [first, second, first]
    assert "(new conversation)" in done.stderr


def test_streamed_replies_are_the_same_text(model, replies):
    out, _ = chat_in_process(model, "w1 w2\nw3\n", stream=True)
    assert out.splitlines() == list(replies)


def test_exit_ends_the_chat(model):
    out, _ = chat_in_process(model, "w1 w2\n/exit\nw3\n")
    assert len(out.splitlines()) == 1


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--chat.ta_prompt", "missing.txt"], "--chat.ta_prompt missing.txt: no such file"),
        (["--chat.stream", "maybe"], "--chat.stream maybe: use auto, true or false"),
        (["--temperature", "-1"], "--chat.temperature -1.0: must be 0 (greedy) or more"),
    ],
)
def test_bad_settings_are_refused_with_the_flag_named(model, capsys, flags, message):
    assert chat.main(["--pretrain", model, *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_old_turns_are_left_out_when_the_conversation_outgrows_max_len(model):
    # a new turn renders to 5 tokens (<|user|> w3 w4 </s> <|assistant|>), the first turn and its reply to at
    # least 6 more: with --chat.max_len 11 the second prompt fits only without the first turn
    out, err = chat_in_process(model, "w1 w2\nw3 w4\n", "--chat.max_len", "11")
    assert "oldest turn(s) no longer fit --chat.max_len 11" in err
    alone = greedy_reply(model, [{"role": "user", "content": "w3 w4"}], max_new_tokens=4)
    assert out.splitlines()[1] == alone.strip()
