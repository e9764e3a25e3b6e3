"""rlhf generate: flags, the checks made before any worker starts, scoring, post-processing and resume.

The tests run the driver and a generation worker in this process; the real command on Ray, killed in the
middle of a write and resumed, is run by tests/test_pipelines.py's iterative DPO test.
"""

import json
from pathlib import Path

import pytest
import torch

from rlhf_cli import generate
from rlhf_core import hookimpl
from rlhf_core.config_parser import parse_config

REWARD = '''
def reward_func(queries, prompts, labels, responses):
    """1.0 when the reply's first word is the label."""
    return [float(r.split()[:1] == [str(label)]) for r, label in zip(responses, labels)]
'''


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from rlhf_core.testing.tiny import make_tiny_llama

    root = tmp_path_factory.mktemp("generate")
    model = make_tiny_llama(root / "model", num_words=20)
    rows = [
        {"input": f"w{i % 20} w{(3 * i) % 20}", "label": f"w{(i + 1) % 20}", "output": f"w{i % 7} w{i % 5}"}
        for i in range(16)
    ]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "reward.py").write_text(REWARD)
    (root / "no_reward_func.py").write_text("def score(texts):\n    return [0.0] * len(texts)\n")
    return {
        "root": root,
        "model": model,
        "prompts": str(root / "prompts.jsonl"),
        "reward": str(root / "reward.py"),
    }


def gen_flags(assets, tmp_path, *extra, drop=()):
    """Flags of a small run; ``extra`` come last (a repeated flag's last value wins), ``drop`` are left out."""
    base = {
        "--pretrain": assets["model"],
        "--dataset": assets["prompts"],
        "--label_key": "label",
        "--remote_rm_url": assets["reward"],
        "--output_path": str(tmp_path / "out.jsonl"),
        "--param_dtype": "fp32",
        "--max_new_tokens": "3",
    }
    return [x for flag, value in base.items() if flag not in drop for x in (flag, value)] + list(extra)


def test_the_plugins_get_generates_own_section_objects():
    cfg, _ = parse_config("generate", ["--pretrain", "m", "--seed", "7", "--rollout_batch_size", "64"])
    rl = generate.plugin_config(cfg)
    assert all(getattr(rl, s) is getattr(cfg, s) for s in ("rollout", "reward", "data", "ds", "vllm", "ray"))
    assert (rl.actor.model_name_or_path, rl.train.seed, rl.rollout.batch_size) == ("m", 7, 64)


def test_openrlhf_flat_flags_set_the_generate_config():
    cfg, notes = parse_config(
        "generate",
        [
            "--pretrain",
            "m",
            "--reward_pretrain",
            "rm",
            "--dataset",
            "d.jsonl",
            "--best_of_n",
            "4",
            "--iter",
            "2",
            "--rollout_batch_size",
            "64",
            "--post_processor",
            "iter_dpo",
            "--greedy_sampling",
            "--tp_size",
            "2",
            "--output_path",
            "o.jsonl",
            "--eval_task",
            "generate_vllm",
            "--micro_batch_size",
            "8",
            "--zero_stage",
            "0",
            "--enable_csft",
            "--csft_prompt",
            "<rm_score>: 1.00",
            "--disable_fast_tokenizer",
        ],
    )
    assert (cfg.model.model_name_or_path, cfg.reward.model_name_or_path, cfg.data.dataset) == (
        "m",
        "rm",
        ["d.jsonl"],
    )
    assert (cfg.rollout.n_samples_per_prompt, cfg.generate.iter, cfg.rollout.batch_size) == (4, 2, 64)
    assert (cfg.generate.post_processor, cfg.rollout.temperature, cfg.vllm.tensor_parallel_size) == (
        "iter_dpo",
        0.0,
        2,
    )
    assert (cfg.generate.task, cfg.rollout.micro_batch_size, cfg.generate.enable_csft) == (
        "generate_vllm",
        8,
        True,
    )
    assert notes == [
        "--zero_stage is ignored: generation runs the policy in rollout engines, not under DeepSpeed",
        "--data.disable_fast_tokenizer changes nothing: transformers 5 has one tokenizer implementation "
        "and ignores use_fast (OpenRLHF passes it on unread too)",
    ]


@pytest.mark.parametrize(
    "extra, drop, message",
    [
        ((), ("--output_path",), "--generate.output_path is required"),
        (
            ("--repetition_penalty", "1.2"),
            (),
            "--rollout.repetition_penalty 1.2: the rollout engines sample without",
        ),
        (
            ("--post_processor", "best_of_all"),
            (),
            "no post-processor named 'best_of_all' (asked for by "
            "--generate.post_processor best_of_all). Registered: ",
        ),
        (("--post_processor", "csft", "--reward_template", "{input} scored"), (), "must contain {reward}"),
        (
            ("--post_processor", "rs"),
            ("--remote_rm_url",),
            "--generate.post_processor rs works on rewards: give a",
        ),
        (
            ("--remote_rm_url", "nowhere.py"),
            (),
            "the reward source cannot score: --reward.remote_url nowhere.py",
        ),
        (
            ("--remote_rm_url", "{root}/no_reward_func.py"),
            (),
            "no_reward_func.py: the file defines no 'reward_func'",
        ),
        (
            ("--reward_pretrain", "{root}"),
            ("--remote_rm_url",),
            "--reward.model_name_or_path {root}: no model there",
        ),
        (
            ("--iter", "1", "--rollout_batch_size", "16"),
            (),
            "--generate.iter 1 with --rollout.batch_size 16 starts at row 16, but the data has only 16 rows",
        ),
        (
            ("--input_key", "question"),
            (),
            "prompts.jsonl row 0: missing key 'question' (set by --data.input_key)",
        ),
        (("--rollout.engine", "vllm"), (), "--rollout.engine vllm cannot run here"),
        (
            ("--reward.clip_range", "-1", "1"),
            (),
            "--reward.clip_range is an option of 'rlhf train ppo' only: "
            "the code of 'rlhf generate' does not use it",
        ),
    ],
)
def test_bad_settings_are_refused_before_any_worker(assets, tmp_path, capsys, extra, drop, message):
    extra = [x.replace("{root}", str(assets["root"])) for x in extra]
    assert generate.main(gen_flags(assets, tmp_path, *extra, drop=drop)) == 2
    err = capsys.readouterr().err
    message = message.replace("{root}", str(assets["root"]))
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out.jsonl.samples.jsonl").exists()


def test_dry_run_prints_the_plan_and_starts_nothing(assets, tmp_path, capsys):
    assert (
        generate.main(gen_flags(assets, tmp_path, "--best_of_n", "4", "--post_processor", "rs", "--dry-run"))
        == 0
    )
    out = capsys.readouterr().out
    assert "# prompts: 16 from" in out and "# generation: 4 sample(s) per prompt with the hf engine" in out
    assert "# reward: reward_func in" in out and "# post-processor: rs" in out
    assert (
        "# precision: fp32 (--ds.param_dtype; auto is bf16 on GPUs, fp32 on CPU)" in out
    )  # --param_dtype fp32
    assert not (tmp_path / "out.jsonl.samples.jsonl").exists()


def test_worker_scores_each_row_with_the_reward_model_in_order(assets, tmp_path):
    """--eval_task rm: the dataset's own responses, scored by a reward model; checked against the model's
    value head read by hand at the last token of prompt + response + EOS."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, LlamaConfig

    from rlhf_core.testing.tiny import make_tiny_tokenizer

    rm_dir = tmp_path / "rm"
    tok = make_tiny_tokenizer(rm_dir, num_words=20)
    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=0,
    )
    AutoModelForSequenceClassification.from_config(config).save_pretrained(rm_dir)
    cfg, _ = parse_config(
        "generate",
        [
            "--eval_task",
            "rm",
            "--reward_pretrain",
            str(rm_dir),
            "--dataset",
            assets["prompts"],
            "--output_path",
            str(tmp_path / "o.jsonl"),
            "--param_dtype",
            "fp32",
            "--micro_batch_size",
            "5",
        ],
    )
    the_plan = generate.plan(cfg)
    assert the_plan.engine is None and the_plan.n == 1
    records = generate.GenerationWorker(cfg, None, 0, 1).run(the_plan.prompts)

    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(rm_dir)
    rows = [json.loads(line) for line in Path(assets["prompts"]).read_text().splitlines()]
    assert [r["output"] for r in records] == [row["output"] for row in rows]
    for rec, row in zip(records, rows):
        ids = tokenizer(row["input"] + " " + row["output"] + " </s>", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            hidden = model.model(torch.tensor([ids])).last_hidden_state
            expected = model.score(hidden)[0, -1, 0].item()
        assert rec["reward"] == pytest.approx(expected, rel=1e-4, abs=1e-5)


def test_resume_cuts_a_partial_line_and_the_samples_of_unfinished_prompts(assets, tmp_path):
    cfg, _ = parse_config("generate", gen_flags(assets, tmp_path, "--best_of_n", "2"))
    the_plan = generate.plan(cfg)
    assert generate.recover_samples(the_plan) == (set(), None)  # a new run: settings recorded, empty file

    def rec(p, j):
        return {"prompt_index": p, "sample_index": j, "input": f"p{p}", "output": f"o{j}", "reward": 1.0}

    done = [rec(0, 0), rec(0, 1), rec(1, 0), rec(1, 1)]
    text = "".join(json.dumps(r) + "\n" for r in done + [rec(2, 0)]) + json.dumps(rec(2, 1))[:20]
    the_plan.samples_path.write_text(text)
    finished, note = generate.recover_samples(the_plan)
    assert finished == {0, 1}
    assert (
        "2 of 16 prompts done; dropped a partial last line and the samples of 1 unfinished prompt(s)" in note
    )
    assert generate.read_samples(the_plan.samples_path) == done

    cfg.rollout.n_samples_per_prompt = 3  # other settings: the samples are not this run's
    with pytest.raises(generate.GenerateError, match="written by a run with other settings"):
        generate.recover_samples(generate.plan(cfg))


def test_url_credentials_are_neither_shown_nor_saved(assets, tmp_path, capsys):
    """--dry-run and the samples' settings file (the resume fingerprint) hold the reward URL without its
    password and token; the code keeps the real URL."""
    url = "http://rm:hunter2pw@127.0.0.1:9/get_reward?token=tok-9876"
    flags = gen_flags(assets, tmp_path, "--remote_rm_url", url)
    assert generate.main([*flags, "--dry-run"]) == 0
    out = capsys.readouterr()
    assert "rm:***@127.0.0.1:9/get_reward?token=***" in out.out
    cfg, _ = parse_config("generate", flags)
    the_plan = generate.plan(cfg)
    generate.recover_samples(the_plan)
    saved = the_plan.samples_path.with_suffix(".meta.json").read_text()
    assert "rm:***@127.0.0.1:9" in saved
    for text in (out.out + out.err, saved):
        assert "hunter2pw" not in text and "tok-9876" not in text
    assert cfg.reward.remote_url == url


def test_a_registered_reward_source_scores_without_change(assets, tmp_path, register_plugin):
    from rlhf_core.types import RewardResult, RewardSource

    class WordCount(RewardSource):
        async def score(self, request):
            counts = [float(len(r.split())) for r in request.responses]
            return RewardResult(rewards=counts, scores=counts)

    class Factory:
        def accepts(self, cfg):
            return False  # only by name

        def create(self, cfg):
            return WordCount()

    class Plugin:
        @staticmethod
        @hookimpl
        def rlhf_register_reward_sources(register):
            register("word_count", Factory())

    register_plugin(Plugin, name="word-count-plugin")
    cfg, _ = parse_config(
        "generate",
        gen_flags(
            assets, tmp_path, "--reward.source", "word_count", "--best_of_n", "2", drop=("--remote_rm_url",)
        ),
    )
    the_plan = generate.plan(cfg)
    assert the_plan.reward == "WordCount"
    records = generate.GenerationWorker(cfg, the_plan.engine, 0, 1).run(the_plan.prompts[:3])
    assert [(r["prompt_index"], r["sample_index"]) for r in records] == [
        (p, j) for p in range(3) for j in range(2)
    ]
    assert [r["reward"] for r in records] == [float(len(r["output"].split())) for r in records]


def test_a_third_party_post_processor_filters_the_output(assets, tmp_path, register_plugin):
    class KeepCorrect:
        def check(self, options):
            pass

        def __call__(self, batch):
            return [{"input": s.input, "output": s.output} for g in batch.groups for s in g if s.reward >= 1]

    class Plugin:
        @staticmethod
        @hookimpl
        def rlhf_register_post_processors(register):
            register("keep_correct", KeepCorrect())

    register_plugin(Plugin, name="keep-correct-plugin")
    cfg, _ = parse_config(
        "generate", gen_flags(assets, tmp_path, "--best_of_n", "2", "--post_processor", "keep_correct")
    )
    the_plan = generate.plan(cfg)
    generate.recover_samples(the_plan)
    # every prompt already generated (as by an earlier run): no worker starts, the filter runs
    records = [
        {
            "prompt_index": p["index"],
            "sample_index": j,
            "input": p["text"],
            "output": f"w{j}",
            "reward": float(j == p["index"] % 2),
        }
        for p in the_plan.prompts
        for j in range(2)
    ]
    records[0]["reward"], records[0]["error"] = (
        None,
        "raised",
    )  # prompt 0's right one is unscorable: not offered
    generate.append_records(the_plan.samples_path, records, 1)
    summary = generate.run_generate(the_plan)
    rows = [json.loads(line) for line in the_plan.output_path.read_text().splitlines()]
    assert rows == [
        {"input": p["text"], "output": f"w{p['index'] % 2}"} for p in the_plan.prompts if p["index"] != 0
    ]
    assert (summary["samples"], summary["unscorable"], summary["rows"]) == (32, 1, 15)
