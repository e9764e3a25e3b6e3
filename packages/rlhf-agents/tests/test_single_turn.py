"""Single-turn rollouts with the HF engine: tokens, log-probs, masks, budgets, seeds, batched rewards."""

from __future__ import annotations

import textwrap

from rlhf_agents import RolloutWorker
from rlhf_agents.loading import load_module
from rlhf_core.types import SamplingParams

REWARD_FILE = """
CALLS = []

def reward_func(queries, prompts, labels, response_ids, finish_reasons):
    CALLS.append({"n": len(queries), "queries": list(queries), "prompts": list(prompts), "labels": list(labels)})
    return {
        "rewards": [float(len(r)) for r in response_ids],
        "scores": [1.0 if f == "stop" else 0.0 for f in finish_reasons],
        "extra_logs": {"label_len": [float(len(x)) for x in labels]},
    }
"""


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_single_turn_trajectories_match_a_teacher_forced_forward(
    tmp_path, async_engine, tokenizer, cfg_factory, check_tokens
):
    reward_path = write(tmp_path, "reward.py", REWARD_FILE)
    cfg = cfg_factory(reward={"remote_url": reward_path}, train={"seed": 7})
    worker = RolloutWorker.from_config(cfg, async_engine, tokenizer)
    given_ids = tokenizer.encode("w9 w8 w7 w6 w5", add_special_tokens=False)
    prompts = [
        {"prompt_text": "w1 w2 w3", "label": "ab", "prompt_uid": 11},
        {"prompt_ids": given_ids, "label": "abcd", "prompt_uid": 12},
    ]
    trajs = worker.rollout(prompts, SamplingParams(n=3, max_new_tokens=6), step=0)
    worker.close()

    assert [(t.prompt_uid, t.sample_index) for t in trajs] == [
        (11, 0),
        (11, 1),
        (11, 2),
        (12, 0),
        (12, 1),
        (12, 2),
    ]
    assert trajs[0].prompt_ids == tokenizer.encode("w1 w2 w3", add_special_tokens=False)
    assert trajs[3].prompt_ids == given_ids  # token ids in: used verbatim
    for t in trajs:
        check_tokens(t)
        assert t.action_mask == [1] * len(t.response_ids)
        assert 1 <= len(t.response_ids) <= 6
        assert t.truncated == (t.finish_reason == "length")
        assert t.finish_reason == "length" or t.response_ids[-1] == tokenizer.eos_token_id
        assert t.reward == float(len(t.response_ids))
        assert t.score == (1.0 if t.finish_reason == "stop" else 0.0)
        assert t.extra_logs["label_len"] == float(len(t.label))

    calls = load_module(reward_path, "test").CALLS
    assert [c["n"] for c in calls] == [6]  # one batched call, not one per sample
    call = calls[0]
    assert call["labels"] == ["ab"] * 3 + ["abcd"] * 3
    assert call["prompts"][0] == "w1 w2 w3"
    assert call["prompts"][3] == tokenizer.decode(given_ids)
    full = trajs[0].prompt_ids + trajs[0].response_ids
    assert call["queries"][0] == tokenizer.decode(full, skip_special_tokens=False)


def test_seeds_make_rollouts_reproducible(tmp_path, async_engine, tokenizer, cfg_factory):
    reward_path = write(tmp_path, "reward.py", REWARD_FILE)
    cfg = cfg_factory(reward={"remote_url": reward_path})
    worker = RolloutWorker.from_config(cfg, async_engine, tokenizer)
    prompts = [{"prompt_text": "w1 w2", "label": "", "prompt_uid": 5}]
    params = SamplingParams(n=4, max_new_tokens=6)
    first = [t.response_ids for t in worker.rollout(prompts, params, step=3)]
    again = [t.response_ids for t in worker.rollout(prompts, params, step=3)]
    other_step = [t.response_ids for t in worker.rollout(prompts, params, step=4)]
    worker.close()
    assert first == again
    assert first != other_step
    assert len({tuple(x) for x in first}) > 1  # the samples of one prompt differ from each other


def test_context_budget_truncates_and_overlong_prompts_are_counted(
    tmp_path, async_engine, tokenizer, cfg_factory
):
    reward_path = write(tmp_path, "reward.py", REWARD_FILE)
    cfg = cfg_factory(reward={"remote_url": reward_path, "max_failure_fraction": 1.0}, data={"max_len": 6})
    worker = RolloutWorker.from_config(cfg, async_engine, tokenizer)
    params = SamplingParams(n=2, max_new_tokens=8, ignore_eos=True)
    prompts = [
        {"prompt_text": "w1 w2 w3 w4", "label": "", "prompt_uid": 0},  # 4 tokens: room for 2
        {"prompt_text": "w1 w2 w3 w4 w5 w6 w7", "label": "", "prompt_uid": 1},  # 7 tokens: no room
    ]
    trajs = worker.rollout(prompts, params, step=0)
    worker.close()
    fits, too_long = trajs[:2], trajs[2:]
    for t in fits:
        assert len(t.prompt_ids) + len(t.response_ids) == 6
        assert t.truncated and t.finish_reason == "length" and t.reward == 2.0
    for t in too_long:
        assert t.response_ids == [] and t.truncated and t.reward is None
        assert "7 tokens" in t.error and "max_len 6" in t.error
    assert worker.last_metrics["error/overlong_prompt"] == 2.0
    assert worker.last_metrics["reward/unscorable"] == 2.0


def test_reward_math_example_scores_a_batch(async_engine, tokenizer, cfg_factory, examples_dir):
    path = str(examples_dir / "reward_math.py")
    cfg = cfg_factory(reward={"remote_url": path})
    worker = RolloutWorker.from_config(cfg, async_engine, tokenizer)
    prompts = [{"prompt_text": f"w{i} w{i + 1}", "label": str(i), "prompt_uid": i} for i in range(4)]
    trajs = worker.rollout(prompts, SamplingParams(n=2, max_new_tokens=6), step=0)
    worker.close()
    assert all(t.reward in (0.0, 1.0) and t.error is None for t in trajs)
    assert all(t.extra_logs["has_answer"] in (0.0, 1.0) for t in trajs)


def test_reward_math_example_finds_and_grades_the_final_answer(examples_dir):
    module = load_module(examples_dir / "reward_math.py", "test")

    def verify(response, label):
        return module.grade_answer(module.extract_answer(response), label)

    assert verify("so the answer is 42.", "42")
    assert verify("first 3, then \\boxed{3/4}", "0.75")
    assert verify("we get 1,000 apples", "1000")
    assert verify("total: $12", "12")
    assert verify("Answer: x = \\dfrac{1}{2}\nDone.", "0.5")
    assert not verify("the answer is 41", "42")
    assert not verify("no number here", "1")
    assert verify("The answer: -7", "-7")
    out = module.reward_func(
        ["q: 2+2? the answer is 4", "q: 1+1? 3"],
        ["q: 2+2? ", "q: 1+1? "],
        ["4", "2"],  # OpenRLHF-style call
    )
    assert out["rewards"].tolist() == [1.0, 0.0]
    assert out["extra_logs"]["has_answer"].tolist() == [1.0, 1.0]
