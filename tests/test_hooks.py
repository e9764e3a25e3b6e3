"""One test per hook: the built-ins arrive through their distribution's entry point, and a third-party
plugin registering under the same hook is seen next to them. test_hook_docs.py requires a test here for
every hook in rlhf_core.hookspecs."""

import pytest

from rlhf_core import hookimpl, plugins
from rlhf_core.plugins import collect, get_plugin_manager


def stand_in(seam):
    """An object with what ``seam`` calls (registration checks it; nothing calls it here)."""
    if seam in plugins.CLASS_MEMBERS:
        return type("ThirdParty", (), dict.fromkeys(plugins.CLASS_MEMBERS[seam], lambda self: None))
    proto = plugins.PROTOCOLS[seam]
    return type("ThirdParty", (proto,), dict.fromkeys(getattr(proto, "__annotations__", {}), None))()


def check_seam(register_plugin, seam, hook, builtins, distribution):
    extra = stand_in(seam)

    class ThirdParty:
        pass

    setattr(ThirdParty, hook, staticmethod(hookimpl(lambda register: register(f"thirdparty_{seam}", extra))))
    register_plugin(ThirdParty, name="thirdparty")
    found = collect(get_plugin_manager(), seam)
    for name in builtins:
        assert name in found, f"{distribution} should register {seam} {name!r}"
        assert found[name].distribution == distribution
    assert found[f"thirdparty_{seam}"].obj is extra
    return found


def test_hook_rlhf_register_advantage_estimators(register_plugin):
    found = check_seam(
        register_plugin,
        "advantage_estimators",
        "rlhf_register_advantage_estimators",
        ["gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "dr_grpo", "opd"],
        "rlhf-algos",
    )
    assert found["gae"].obj.needs_critic and not found["group_norm"].obj.needs_critic


def test_hook_rlhf_register_policy_losses(register_plugin):
    check_seam(register_plugin, "policy_losses", "rlhf_register_policy_losses", ["ppo", "gspo"], "rlhf-algos")


def test_hook_rlhf_register_kl_estimators(register_plugin):
    check_seam(
        register_plugin, "kl_estimators", "rlhf_register_kl_estimators", ["k1", "k2", "k3"], "rlhf-algos"
    )


def test_hook_rlhf_register_agent_executors(register_plugin):
    check_seam(
        register_plugin,
        "agent_executors",
        "rlhf_register_agent_executors",
        ["single_turn", "multi_turn", "openai_server"],
        "rlhf-agents",
    )


def test_hook_rlhf_register_environments(register_plugin):
    found = check_seam(
        register_plugin, "environments", "rlhf_register_environments", ["guess_number"], "rlhf-example-plugin"
    )
    assert hasattr(found["guess_number"].obj, "step")


def test_hook_rlhf_register_reward_sources(register_plugin):
    check_seam(
        register_plugin,
        "reward_sources",
        "rlhf_register_reward_sources",
        ["python_file", "http", "reward_model"],
        "rlhf-agents",
    )


def test_hook_rlhf_register_placement_strategies(register_plugin):
    check_seam(
        register_plugin,
        "placement_strategies",
        "rlhf_register_placement_strategies",
        ["colocate_all", "colocate_actor_ref", "colocate_critic_reward", "separate"],
        "rlhf-cli",
    )


def test_hook_rlhf_register_rollout_engines(register_plugin):
    found = check_seam(
        register_plugin, "rollout_engines", "rlhf_register_rollout_engines", ["hf"], "rlhf-core"
    )
    assert found["hf"].obj.available() is None
    vllm = found.get("vllm")
    assert vllm is not None and vllm.distribution == "rlhf-rollout-vllm"
    try:
        import vllm as _  # noqa: F401
    except ImportError:
        assert "vllm" in vllm.obj.available()


def test_hook_rlhf_register_train_backends(register_plugin):
    check_seam(
        register_plugin,
        "train_backends",
        "rlhf_register_train_backends",
        ["deepspeed"],
        "rlhf-train-deepspeed",
    )


@pytest.mark.parametrize("seam", ["advantage_estimators", "policy_losses", "kl_estimators"])
def test_algorithm_builtins_satisfy_their_protocols(seam):
    from rlhf_core import types

    proto = {
        "advantage_estimators": types.AdvantageEstimator,
        "policy_losses": types.PolicyLoss,
        "kl_estimators": types.KLEstimator,
    }[seam]
    for reg in collect(get_plugin_manager(), seam).values():
        assert isinstance(reg.obj, proto), f"{reg.name} from {reg.distribution}"


def test_hook_rlhf_register_post_processors(register_plugin):
    found = check_seam(
        register_plugin,
        "post_processors",
        "rlhf_register_post_processors",
        ["rs", "iter_dpo", "csft"],
        "rlhf-core",
    )
    from rlhf_core.types import PostProcessor

    assert all(isinstance(found[name].obj, PostProcessor) for name in ("rs", "iter_dpo", "csft"))
