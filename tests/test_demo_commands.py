"""The README shows the commands `rlhf demo` and `rlhf demo --real` run: each command of its two demo blocks
equals the demo's own, flag by flag (paths as the README writes them: `runs/demo/...`, `~/...`)."""

import re
import shlex
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def readme_commands(section: str) -> list[list[str]]:
    """The commands of the first bash block under the README heading ``section``, continuation lines joined."""
    text = README.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def flags(argv: list[str]) -> dict[str, tuple[str, ...]]:
    """``--flag`` -> its values, of ``rlhf train MODE --flag value ...``."""
    out: dict[str, tuple[str, ...]] = {}
    for token in argv[3:]:
        if token.startswith("--"):
            out[token] = ()
        else:
            out[next(reversed(out))] += (token,)
    return out


def as_shown(argv: list[str], work: Path, shown_work: str) -> list[str]:
    """``argv`` with the demo's work directory and the home directory written as the README writes them."""
    return [t.replace(str(work), shown_work).replace(str(Path.home()), "~") for t in argv]


def test_the_readme_demo_commands_are_the_ones_the_demo_runs(tmp_path):
    from rlhf_cli.demo import commands, make_assets

    files = make_assets(tmp_path)  # the demo's own files: their names are what the commands name
    ran = [as_shown(cmd, tmp_path, "runs/demo") for _, cmd in commands(files, tmp_path, quick=False)]
    shown = readme_commands("What the demo does")
    assert (
        [c[:3] for c in shown] == [c[:3] for c in ran] == [["rlhf", "train", "sft"], ["rlhf", "train", "ppo"]]
    )
    for readme, demo in zip(shown, ran):
        assert flags(readme) == flags(demo)

    # `rlhf demo --rollout.engine vllm`: the README names what its RL command has instead of colocation
    vllm = as_shown(commands(files, tmp_path, False, "vllm")[1][1], tmp_path, "runs/demo")
    has, instead = re.search(r"the RL command has `([^`]+)` in place of\s+`([^`]+)`", README).groups()
    assert flags(ran[1][:3] + shlex.split(has)).items() == flags(vllm).items() - flags(ran[1]).items()
    assert flags(ran[1][:3] + shlex.split(instead)).items() == flags(ran[1]).items() - flags(vllm).items()


def test_the_readme_real_demo_command_is_the_one_rlhf_demo_real_runs(tmp_path, monkeypatch):
    from rlhf_cli.demo import REAL_QUESTION, REAL_REWARD_FILE, real_commands, write_task
    from rlhf_core.testing import smollm2

    monkeypatch.delenv("RLHF_CACHE", raising=False)  # the README names the default cache
    # what make_real_assets returns, without building the model: the cache path smollm2_dir() returns
    files = {
        "base": smollm2.cache_root() / smollm2.MODEL_NAME,
        **write_task(tmp_path, [], [], REAL_QUESTION.format, REAL_REWARD_FILE),
    }
    ((_, cmd),) = real_commands(files, tmp_path, quick=False)
    (shown,) = readme_commands("The demo on a real model: `rlhf demo --real`")
    ran = as_shown(cmd, tmp_path, "runs/real-demo")
    assert shown[:3] == ran[:3] == ["rlhf", "train", "ppo"]
    assert flags(shown) == flags(ran)


def test_rlhf_help_lists_every_option_of_rlhf_demo(capsys):
    """`rlhf --help` shows `rlhf demo` with the options `rlhf demo --help` has, `--real` among them."""
    from rlhf_cli.main import main

    assert main(["--help"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("rlhf demo")]
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    options = set(re.findall(r"(--[a-z.]+)", capsys.readouterr().out)) - {"--help"}
    assert "--real" in options and set(re.findall(r"(--[a-z.]+)", line)) == options
