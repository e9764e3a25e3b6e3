"""Configuration: seed commands parse, flat and dotted spellings agree, YAML files and errors."""

import re
import sys
import types
from pathlib import Path

import pytest
from seed_commands import SEEDS, seed_commands

from rlhf_cli.assemble import HUB_OFFLINE_VARS, RunConfigError, assemble, is_hub_id
from rlhf_core.config import RLConfig
from rlhf_core.config_parser import ConfigError, config_to_yaml, parse_config

DOTTED = Path(__file__).parent / "data" / "dotted"
needs_seeds = pytest.mark.skipif(not SEEDS.is_dir(), reason=f"seed documents not found at {SEEDS}")


def _seed_ids():
    return [c.source for c in seed_commands()] if SEEDS.is_dir() else []


STAND_INS = {  # what the driver checks in a user's file: it imports, and defines what the flag needs
    "reward": "def reward_func(queries, prompts, labels, **kwargs):\n    return [0.0] * len(queries)\n",
    "agent": "from rlhf_agents import SingleTurnAgentExecutor\n\n\nclass AgentExecutor(SingleTurnAgentExecutor):\n"
    "    pass\n",
}


def _with_real_files(argv: list[str], tmp_path: Path, model: str) -> list[str]:
    """Point the commands' reward/agent files and local model paths at ones that exist, as on the user's
    machine (hub ids stay: the driver accepts them where the hub is reachable)."""
    out = []
    for flag, tok in zip([""] + argv, argv):
        if tok.endswith(".py") and not tok.startswith("--"):
            real = tmp_path / Path(tok).name
            real.write_text(STAND_INS["agent" if "agent" in flag else "reward"])
            tok = str(real)
        elif ("pretrain" in flag or "model_name_or_path" in flag) and not is_hub_id(tok):
            tok = model
        out.append(tok)
    return out


@pytest.fixture
def wandb_installed(monkeypatch):
    """Several seed commands log to W&B, whose package is not installed here: the parser only checks that it
    can be imported, so an empty stand-in module is enough."""
    monkeypatch.setitem(sys.modules, "wandb", types.ModuleType("wandb"))


@needs_seeds
def test_seed_documents_hold_the_expected_commands():
    modes = [c.mode for c in seed_commands()]
    assert modes.count("ppo") >= 20 and {"rm", "dpo", "sft"} <= set(modes)


# Seed commands that are wrong as printed: the dry run must refuse them and say why.
INVALID_SEEDS = {
    # "GRPO" with the default single sample per prompt: a group baseline of one sample is undefined
    # (OpenRLHF divides by the std of one value and trains on NaN advantages).
    "001_1e91fc2fda3d697a.txt:121": "needs --rollout.n_samples_per_prompt >= 2 (got 1)",
    # fragments that show a few flags (placement, resume) and leave the reward out
    **dict.fromkeys(
        ["001_1e91fc2fda3d697a.txt:379", "001_1e91fc2fda3d697a.txt:875", "001_1e91fc2fda3d697a.txt:947"],
        "no reward: give --reward.remote_url",
    ),
    # a fragment that elides the model with "..."
    "003_544c3f1a9d6a8d2f.txt:645": "--actor.model_name_or_path is required",
}


@needs_seeds
@pytest.mark.parametrize("source", _seed_ids())
def test_every_seed_command_parses_and_plans(source, tmp_path, tiny_model, monkeypatch, wandb_installed):
    for var in HUB_OFFLINE_VARS:  # the commands name hub models, which a user with hub access can use
        monkeypatch.delenv(var, raising=False)
    (cmd,) = [c for c in seed_commands() if c.source == source]
    cfg, _ = parse_config(cmd.mode, _with_real_files(cmd.argv, tmp_path, tiny_model))
    if source in INVALID_SEEDS:
        with pytest.raises(RunConfigError, match=re.escape(INVALID_SEEDS[source])):
            assemble(cmd.mode, cfg, gpus=True)
        return
    asm = assemble(cmd.mode, cfg, gpus=True)  # the seeds target GPU clusters
    assert asm.chosen["train_backends"] == "deepspeed"
    if cmd.mode == "ppo":
        assert asm.plan is not None and {g.role for g in asm.plan.groups} >= {"actor", "rollout"}


@needs_seeds
@pytest.mark.parametrize("name", sorted(p.name for p in DOTTED.glob("*.sh")))
def test_dotted_spelling_resolves_to_the_same_config(name, wandb_installed):
    text = (DOTTED / name).read_text()
    source = text.splitlines()[0].split()[1].replace("seeds/", "")  # "# seeds/000 line 86 ..."
    line = text.splitlines()[0].split()[3]
    (cmd,) = [c for c in seed_commands() if c.source.startswith(source) and c.source.endswith(f":{line}")]
    dotted = " ".join(ln for ln in text.splitlines() if not ln.startswith("#")).split()
    if "--input_template" in cmd.argv:  # a value with spaces: carried over verbatim
        dotted += ["--data.input_template", cmd.argv[cmd.argv.index("--input_template") + 1]]
    flat_cfg, _ = parse_config(cmd.mode, cmd.argv)
    dotted_cfg, _ = parse_config(cmd.mode, dotted)
    assert flat_cfg == dotted_cfg
    assert flat_cfg != type(flat_cfg)()  # the command changed something


def test_flat_aliases_that_set_several_fields():
    cfg, notes = parse_config(
        "ppo",
        [
            "--adam_betas",
            "0.8",
            "0.9",
            "--ref_reward_offload",
            "--bf16",
            "--clip_eps_high",
            "0.28",
            "--eps_clip",
            "0.1",
            "--ptx_coef",
            "0.5",
        ],
    )
    assert cfg.actor.adam.betas == cfg.critic.adam.betas == (0.8, 0.9)
    assert cfg.ref.offload and cfg.reward.offload
    assert cfg.ds.param_dtype == "bf16"
    assert cfg.actor.eps_clip_low_high == (0.1, 0.28)  # the missing side falls back to --eps_clip
    assert any("--ptx_coef" in n for n in notes)


def test_supervised_optimizer_flags_without_prefix():
    cfg, _ = parse_config(
        "sft", ["--adam.lr", "3e-5", "--learning_rate", "2e-5", "--lr_scheduler", "constant"]
    )
    assert cfg.model.adam.lr == 2e-5  # the later flag wins
    assert cfg.model.lr_scheduler == "constant"


def test_unknown_flag_suggests_the_closest_spelling():
    with pytest.raises(ConfigError, match=r"--algo\.advantage\.estimator"):
        parse_config("ppo", ["--algo.advantage.estimater", "rloo"])
    with pytest.raises(ConfigError, match="--advantage_estimator"):
        parse_config("ppo", ["--advantage_estimater", "rloo"])


def test_mode_specific_sections_are_rejected_elsewhere():
    with pytest.raises(ConfigError, match="--actor.eps_clip.*rlhf train sft"):
        parse_config("sft", ["--actor.eps_clip", "0.3"])


def test_wrong_type_names_the_flag():
    with pytest.raises(ConfigError, match="--ds.zero_stage"):
        parse_config("ppo", ["--ds.zero_stage", "three"])
    with pytest.raises(ConfigError, match="--train.colocate_all"):
        parse_config("ppo", ["--train.colocate_all", "maybe"])


def test_yaml_nested_dotted_and_flat_keys_with_cli_override(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text(
        "actor:\n  model_name_or_path: /m\n  adam: {lr: 2.0e-6}\n"
        "algo.advantage.estimator: rloo\n"
        "n_samples_per_prompt: 4\n"
        "train:\n  colocate_all: true\n"
    )
    cfg, _ = parse_config("ppo", ["--config", str(f), "--actor.adam.lr", "3e-6"])
    assert cfg.actor.model_name_or_path == "/m"
    assert cfg.algo.advantage.estimator == "rloo"
    assert cfg.rollout.n_samples_per_prompt == 4
    assert cfg.train.colocate_all is True
    assert cfg.actor.adam.lr == 3e-6


def test_yaml_errors_name_the_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("actor:\n  eps_clp: 0.3\n")
    with pytest.raises(ConfigError, match=rf"in {f}.*did you mean --actor\.eps_clip"):
        parse_config("ppo", ["--config", str(f)])
    f.write_text("actor: [unclosed\n")
    with pytest.raises(ConfigError, match=f"--config {f}: not valid YAML"):
        parse_config("ppo", ["--config", str(f)])
    with pytest.raises(ConfigError, match="no such file"):
        parse_config("ppo", ["--config", str(tmp_path / "missing.yaml")])


def test_resolved_config_round_trips_through_yaml(tmp_path):
    cfg, _ = parse_config(
        "ppo",
        [
            "--pretrain",
            "/m",
            "--reward_clip_range",
            "-3",
            "3",
            "--train.colocate_all",
            "--data.prompt_dataset",
            "a.jsonl,b.jsonl",
            "--data.prompt_probs",
            "0.3",
            "0.7",
        ],
    )
    f = tmp_path / "config.yaml"
    f.write_text(config_to_yaml(cfg, "ppo"))
    again, _ = parse_config("ppo", ["--config", str(f)])
    assert again == cfg
    assert again.reward.clip_range == (-3.0, 3.0)
    assert again.data.prompt_dataset == ["a.jsonl", "b.jsonl"]


def test_defaults_follow_openrlhf():
    cfg = RLConfig()
    assert cfg.algo.advantage.estimator == "gae"
    assert cfg.actor.eps_clip == 0.2 and cfg.critic.value_clip == 0.5
    assert cfg.actor.adam.lr == 1e-6 and cfg.critic.adam.lr == 9e-6
    assert cfg.reward.clip_range == (-10.0, 10.0)


def test_openrlhf_prm_and_kd_script_flags_parse():
    """The flags of OpenRLHF's removed train_prm_mistral.sh and train_knowledge_distillation.sh."""
    prm, notes = parse_config(
        "prm",
        [
            "--pretrain",
            "mistralai/Mistral-7B-v0.1",
            "--dataset",
            "zhuzilin/Math-Shepherd",
            "--input_key",
            "input",
            "--label_key",
            "value",
            "--placeholder_token",
            "ки",
            "--reward_tokens",
            "+",
            "-",
            "--max_len",
            "8192",
            "--zero_stage",
            "3",
            "--train_batch_size",
            "256",
            "--micro_train_batch_size",
            "8",
            "--learning_rate",
            "1e-6",
            "--save_steps",
            "500",
            "--eval_steps",
            "100",
            "--packing_samples",
            "--load_checkpoint",
            "--bf16",
            "--save_path",
            "./checkpoint/mistal-7b-prm",
        ],
    )
    assert (prm.prm.placeholder_token, prm.prm.reward_tokens, prm.data.label_key) == (
        "ки",
        ["+", "-"],
        "value",
    )
    assert prm.ds.packing_samples and prm.ckpt.load_enable and prm.model.adam.lr == 1e-6 and not notes
    kd, _ = parse_config(
        "kd",
        [
            "--pretrain",
            "meta-llama/Meta-Llama-3-8B-Instruct",
            "--teacher_model",
            "meta-llama/Meta-Llama-3-70B-Instruct",
            "--teacher_offload",
            "--kd_coef",
            "0.4",
            "--dataset",
            "Open-Orca/OpenOrca",
            "--input_key",
            "question",
            "--output_key",
            "response",
            "--max_samples",
            "500000",
            "--train_batch_size",
            "256",
            "--micro_train_batch_size",
            "2",
            "--zero_stage",
            "3",
            "--learning_rate",
            "5e-6",
            "--bf16",
        ],
    )
    assert kd.teacher.model_name_or_path == "meta-llama/Meta-Llama-3-70B-Instruct"
    assert kd.teacher.offload and kd.teacher.kd_coef == 0.4 and kd.data.output_key == "response"
    dotted, _ = parse_config(
        "kd", ["--teacher.model_name_or_path", "t", "--teacher.kd_coef", "0.4", "--teacher.offload"]
    )
    assert dotted.teacher == kd.teacher.__class__("t", True, 0.4)


def test_generate_and_chat_read_views_of_the_train_sections_in_their_order_words_and_defaults():
    from rlhf_core.config import DataConfig, GenerateConfig, RolloutConfig
    from rlhf_core.config_parser import leaves

    gen, ppo = leaves("generate"), leaves("ppo")
    assert [p for p in gen if p.startswith("rollout.")] == [
        f"rollout.{name}"
        for name in "engine n_samples_per_prompt max_new_tokens temperature top_p top_k repetition_penalty "
        "batch_size micro_batch_size".split()
    ]
    assert type(GenerateConfig().rollout) is RolloutConfig and type(GenerateConfig().data) is DataConfig
    # its own defaults and words; the section's elsewhere
    assert (gen["rollout.batch_size"].default, ppo["rollout.batch_size"].default) == (2048, 1024)
    assert gen["data.max_len"].doc.startswith("``--generate.task rm``")
    assert ppo["data.max_len"].doc.startswith("Most tokens per sequence")
    assert gen["rollout.top_p"].doc == ppo["rollout.top_p"].doc
    # a view takes a field whatever its modes; a field only a view lists stays out of the train modes
    assert "data.dataset" in gen and "data.dataset" not in ppo
    assert "rollout.repetition_penalty" not in ppo
    with pytest.raises(ConfigError, match="--rollout.min_new_tokens is an option of 'rlhf train ppo' only"):
        parse_config("generate", ["--rollout.min_new_tokens", "3"])
    cfg, _ = parse_config("chat", [])
    assert cfg.data.input_template == "User: {}\nAssistant: " and list(leaves("chat")) == [
        *(p for p in leaves("chat") if p.startswith(("model.", "chat."))),
        "data.input_template",
        "data.apply_chat_template",
        "data.tokenizer_chat_template",
        "ds.param_dtype",
        "ds.attn_implementation",
    ]
    # a config object holding a field its view leaves out is refused, naming the modes that read it
    base = GenerateConfig()
    base.ds.lora.rank = 4
    with pytest.raises(ConfigError, match=r"--ds.lora.rank is an option of 'rlhf train ppo\|sft\|rm"):
        parse_config("generate", [], base)
    assert "train.async_enable" in leaves("ppo") and "train.async_enable" not in leaves("sft")
    # a default set by a section's factory is the field's default (what refusals compare with)
    assert ppo["critic.adam.lr"].default == 9e-6 and leaves("sft")["model.adam.lr"].default == 5e-6
