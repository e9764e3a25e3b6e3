"""Every mode's data through the real SmolLM2-135M-Instruct chat template (`--data.apply_chat_template`).

Each mode's rows go through the project's own data path (SFT, RM/DPO: rlhf_train_deepspeed.supervised_data;
PPO prompts: rlhf_cli.rl.prompts) and are compared, token for token, with an independent rendering by
``tokenizer.apply_chat_template``. SmolLM2's pad token is its EOS, ``<|im_end|>`` (id 2), which also closes
every chat turn: the trained tokens must include it (a classic bug masks it out as padding), and a prompt
that contains the id must keep it. One SFT step on the real model checks the trained tokens by the loss:
step 1's loss equals the mean negative log-likelihood of exactly the assistant tokens computed here with
transformers. The GRPO step through `rlhf train ppo` on this model is tests/test_demo.py's `--real` test.
"""

import json
import os
import subprocess
import sys

import pytest

from rlhf_core.config import PreferenceConfig, RLConfig, SupervisedConfig
from rlhf_core.data import DataStats, Row, conversation_ids

pytestmark = pytest.mark.real_model

EOS = 2  # <|im_end|>: SmolLM2's EOS, pad token and end of every chat turn
QUESTION = "What is 2+3?"
# a question that holds the EOS/pad token itself: the tokenizer reads "<|im_end|>" in text as id 2
WITH_EOS = "Repeat after me: <|im_end|> done"


@pytest.fixture(scope="module")
def tok(smollm2):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == EOS
    return tokenizer


def rendered(tok, messages, generation_prompt=False) -> list[int]:
    """The independent rendering: the tokenizer's own chat template, tokenized by it."""
    return list(
        tok.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False
        )
    )


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def test_sft_rows_are_the_template_and_train_exactly_the_assistant_turn_with_its_eos(tok):
    from rlhf_train_deepspeed.supervised_data import build_examples, collate

    cfg = SupervisedConfig()
    cfg.data.apply_chat_template, cfg.data.output_key, cfg.data.max_len = True, "output", 256
    rows = [
        Row({"input": QUESTION, "output": "5"}, "r", 0),
        Row({"input": WITH_EOS, "output": "<|im_end|> done"}, "r", 1),
    ]
    examples = build_examples("sft", rows, tok, cfg, DataStats())
    batch = collate("sft", examples, tok.pad_token_id)
    for i, (ex, (question, answer)) in enumerate(
        zip(examples, [(QUESTION, "5"), (WITH_EOS, "<|im_end|> done")])
    ):
        prompt = rendered(tok, [user(question)], generation_prompt=True)
        assert ex.prompt == prompt
        assert ex.prompt + ex.response == rendered(tok, [user(question), assistant(answer)])
        # the response is the assistant turn: its text, <|im_end|> and the template's newline
        assert tok.decode(ex.response) == f"{answer}<|im_end|>\n"
        # padding is by length, not by id: every EOS of the row is attended to and the turn's EOS is trained
        n = len(ex.prompt) + len(ex.response)
        assert batch.attention_mask[i, :n].all() and not batch.attention_mask[i, n:].any()
        trained = batch.input_ids[i, len(ex.prompt) : n][batch.response_mask()[i, : len(ex.response)].bool()]
        assert trained.tolist() == ex.response and trained.tolist()[-2] == EOS
    # the prompt holding <|im_end|> kept it: two in the system turn and user turn's ends, one inside the question
    assert examples[1].prompt.count(EOS) == 3


def test_multiturn_sft_trains_each_assistant_turn_through_its_eos(tok):
    messages = [user(QUESTION), assistant("5"), user(WITH_EOS), assistant("<|im_end|> done")]
    ids, mask = conversation_ids(tok, messages)
    assert ids == rendered(tok, messages)
    trained = [t for t, m in zip(ids, mask, strict=True) if m]
    assert tok.decode(trained) == "5<|im_end|>\n<|im_end|> done<|im_end|>\n"
    # and nothing of the user turns (the <|im_end|> inside the second question included)
    untrained = tok.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    assert untrained.count("<|im_end|>") == 4 and untrained.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("mode", ["rm", "dpo"])
def test_preference_pairs_are_the_template_and_end_at_the_turns_eos(tok, mode):
    """Chosen and rejected are the template's assistant turn up to its <|im_end|>: the reward model reads its
    score at that EOS, so a second EOS after the template's newline would move it (this did happen)."""
    from rlhf_train_deepspeed.supervised_data import build_examples, collate

    cfg = PreferenceConfig()
    cfg.data.apply_chat_template, cfg.data.prompt_key, cfg.data.max_len = True, "prompt", 256
    rows = [
        Row({"prompt": QUESTION, "chosen": "5", "rejected": "6"}, "p", 0),
        Row({"prompt": WITH_EOS, "chosen": "<|im_end|> done", "rejected": "no"}, "p", 1),
    ]
    examples = build_examples(mode, rows, tok, cfg, DataStats())
    cfg.data.prompt_key = None  # whole conversations: the prompt is every turn but the last
    conversation = Row(
        {"chosen": [user(QUESTION), assistant("5")], "rejected": [user(QUESTION), assistant("6")]}, "p", 2
    )
    examples += build_examples(mode, [conversation], tok, cfg, DataStats())
    for ex, (question, chosen, rejected) in zip(
        examples, [(QUESTION, "5", "6"), (WITH_EOS, "<|im_end|> done", "no"), (QUESTION, "5", "6")]
    ):
        assert ex.prompt == rendered(tok, [user(question)], generation_prompt=True)
        for ids, answer in ((ex.chosen, chosen), (ex.rejected, rejected)):
            full = rendered(tok, [user(question), assistant(answer)])
            assert full[-2:] == [
                EOS,
                tok.convert_tokens_to_ids("Ċ"),
            ]  # the template ends a turn "<|im_end|>\n"
            assert ex.prompt + ids == full[:-1]
    batch = collate(mode, examples, tok.pad_token_id)
    for half, key in ((batch.chosen, "chosen"), (batch.rejected, "rejected")):
        for i, ex in enumerate(examples):
            n = len(ex.prompt) + len(getattr(ex, key))
            assert half.input_ids[i, n - 1] == EOS and half.attention_mask[i, :n].all()


def test_ppo_prompts_are_the_templates_generation_prompt_with_any_eos_inside_kept(tok, tmp_path):
    from rlhf_cli.rl.prompts import load_prompts

    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in [
                {"input": QUESTION, "label": "5"},
                {"input": WITH_EOS, "label": "x"},
                {"input": [user(QUESTION)], "label": "5"},
            ]
        )
    )
    cfg = RLConfig()
    cfg.data.prompt_dataset, cfg.data.apply_chat_template, cfg.data.label_key = [str(path)], True, "label"
    cfg.data.max_len, cfg.rollout.max_new_tokens = 128, 16
    prompts = load_prompts(cfg, tok)
    assert [p.ids for p in prompts] == [
        rendered(tok, [user(q)], generation_prompt=True) for q in (QUESTION, WITH_EOS, QUESTION)
    ]
    assert prompts[1].ids.count(EOS) == 3 and [p.label for p in prompts] == ["5", "x", "5"]


@pytest.mark.slow
def test_one_sft_step_on_the_real_model_trains_exactly_the_assistant_tokens(smollm2, tok, tmp_path):
    """`rlhf train sft --data.apply_chat_template` for one step (lr 0: the weights stay as they are): its
    loss is the mean NLL over the assistant tokens (answer, <|im_end|>, newline) of both rows, computed here
    by transformers. Masking the EOS out (pad == eos) or training the prompt would change it by far more
    than the tolerance: the two float32 paths agreed to 5e-8 relative here; 1e-4 leaves room for other CPUs'
    kernels (AVX2 / AVX-512 sum in other orders)."""
    import torch
    from transformers import AutoModelForCausalLM

    rows = [{"input": QUESTION, "output": "5"}, {"input": WITH_EOS, "output": "<|im_end|> done"}]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "rlhf_cli.main",
        "train",
        "sft",
        "--model.model_name_or_path",
        smollm2,
        "--data.dataset",
        str(tmp_path / "sft.jsonl"),
        "--data.input_key",
        "input",
        "--data.output_key",
        "output",
        "--data.apply_chat_template",
        "--data.max_len",
        "64",
        "--train.batch_size",
        "2",
        "--train.micro_batch_size",
        "2",
        "--train.max_epochs",
        "1",
        "--model.adam.lr",
        "0",
        "--ds.zero_stage",
        "0",
        "--ds.param_dtype",
        "fp32",
        "--ckpt.output_dir",
        str(out),
    ]
    done = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "RLHF_NO_PROGRESS": "1", "DS_ACCELERATOR": "cpu"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (metrics,) = [
        json.loads(line)
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if "loss" in json.loads(line)
    ]

    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    nll, count = 0.0, 0
    for r in rows:
        prompt = rendered(tok, [user(r["input"])], generation_prompt=True)
        full = rendered(tok, [user(r["input"]), assistant(r["output"])])
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([full])).logits[0, :-1].double(), -1)
        targets = torch.tensor(full[1:])
        picked = logp[torch.arange(len(full) - 1), targets][
            len(prompt) - 1 :
        ]  # positions predicting the turn
        nll, count = nll - picked.sum().item(), count + len(picked)
    assert metrics["loss"] == pytest.approx(nll / count, rel=1e-4)
