"""Loading plugins and looking up what they registered (the loader's rules: ``docs/plugin-hooks.md``)."""

from __future__ import annotations

import difflib
import importlib.metadata as md
import os
import sys
from dataclasses import dataclass
from typing import Any

import pluggy

from rlhf_core import hookspecs, types
from rlhf_core.errors import UserError

# seam -> what one of its objects is called in messages. The order is the order ``rlhf plugins`` prints.
SINGULAR = {
    "advantage_estimators": "advantage estimator",
    "policy_losses": "policy loss",
    "kl_estimators": "KL estimator",
    "agent_executors": "agent executor",
    "environments": "environment",
    "reward_sources": "reward source",
    "tool_parsers": "tool-call parser",
    "post_processors": "post-processor",
    "placement_strategies": "placement strategy",
    "rollout_engines": "rollout engine",
    "train_backends": "train backend",
}
# seam -> hook name
SEAMS: dict[str, str] = {seam: f"rlhf_register_{seam}" for seam in SINGULAR}

# Names the first-party packages register, so that asking for one that is missing says what to install.
KNOWN_PROVIDERS: dict[str, dict[str, str]] = {
    "advantage_estimators": dict.fromkeys(
        ["gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "dr_grpo", "opd"], "rlhf-algos"
    ),
    "policy_losses": dict.fromkeys(["ppo", "gspo"], "rlhf-algos"),
    "kl_estimators": dict.fromkeys(["k1", "k2", "k3"], "rlhf-algos"),
    "agent_executors": dict.fromkeys(["single_turn", "multi_turn", "openai_server"], "rlhf-agents"),
    "environments": {},
    "reward_sources": dict.fromkeys(["python_file", "http", "reward_model", "prm"], "rlhf-agents"),
    "tool_parsers": dict.fromkeys(
        ["hermes", "llama3_json", "mistral", "deepseek_v3", "qwen3_coder", "glm45", "harmony"], "rlhf-agents"
    ),
    "post_processors": dict.fromkeys(["rs", "iter_dpo", "csft"], "rlhf-core"),
    "placement_strategies": dict.fromkeys(
        ["colocate_all", "colocate_actor_ref", "colocate_critic_reward", "separate"], "rlhf-cli"
    ),
    "rollout_engines": {"hf": "rlhf-core", "vllm": "rlhf-rollout-vllm[vllm]"},
    "train_backends": {"deepspeed": "rlhf-train-deepspeed"},
}


# What each seam's objects must provide, checked when they are registered: a plugin that registers the wrong
# thing (a plain function as an estimator) is refused at start-up, naming itself, instead of failing later
# with an AttributeError inside a worker. Executors and environments are registered as classes.
PROTOCOLS: dict[str, type] = {
    "advantage_estimators": types.AdvantageEstimator,
    "policy_losses": types.PolicyLoss,
    "kl_estimators": types.KLEstimator,
    "reward_sources": types.RewardSourceFactory,
    "post_processors": types.PostProcessor,
    "placement_strategies": types.PlacementStrategy,
    "rollout_engines": types.RolloutEngineFactory,
    "train_backends": types.TrainBackend,
}
CLASS_MEMBERS: dict[str, tuple[str, ...]] = {
    "agent_executors": ("execute",),  # a subclass of rlhf_agents.AgentExecutorBase
    "environments": ("reset", "step"),  # a subclass of rlhf_agents.AgentInstanceBase
    "tool_parsers": ("markers", "parse", "opening"),  # rlhf_agents.tool_parsers
}


# Plugins registered for the duration of one test by the `register_plugin` fixture of rlhf_core.testing.
_TEST_PLUGINS: list[tuple[str, object]] = []


class PluginError(UserError):
    """A plugin could not be loaded, registered a duplicate, or a requested name is missing."""


@dataclass(frozen=True)
class Registered:
    """One object a plugin registered, with where it came from."""

    seam: str
    name: str
    obj: Any
    distribution: str
    version: str


def _env_names(var: str) -> set[str] | None:
    """The names listed in ``$var`` (comma-separated), normalised; None when it is unset."""
    value = os.environ.get(var)
    return None if value is None else {_normalise(x.strip()) for x in value.split(",") if x.strip()}


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-")


def get_plugin_manager(load_entrypoints: bool = True) -> pluggy.PluginManager:
    """A new plugin manager (none is shared: tests and Ray actors build their own from plugin names) with the
    ``rlhf`` entry points that ``RLHF_LOAD_PLUGINS`` / ``RLHF_DISABLE_PLUGINS`` allow loaded (both take
    distribution or entry-point names; an empty LOAD loads none); ``RLHF_TRACE_PLUGINS=1`` prints every hook
    call. ``check_pending()`` makes a misspelled hook implementation fail here instead of being ignored."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    # plugin name -> (distribution, version), for provenance in `rlhf plugins` and run metadata
    pm.rlhf_distributions = {}
    if load_entrypoints:
        only, blocked = _env_names("RLHF_LOAD_PLUGINS"), _env_names("RLHF_DISABLE_PLUGINS") or set()
        for ep in md.entry_points(group=hookspecs.PROJECT):
            dist = ep.dist.name if ep.dist is not None else ep.name
            keys = {_normalise(dist), _normalise(ep.name)}
            if keys & blocked or (only is not None and not keys & only) or pm.get_plugin(ep.name) is not None:
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken third-party plugin must say who it is
                raise PluginError(
                    f"could not load rlhf plugin {ep.name!r} ({ep.value}) from distribution "
                    f"{dist!r}: {type(exc).__name__}: {exc}. {_skip_hint(dist)}"
                ) from exc
            pm.register(plugin, name=ep.name)
            pm.rlhf_distributions[ep.name] = (dist, ep.dist.version if ep.dist is not None else "")
    for name, plugin in _TEST_PLUGINS:
        pm.register(plugin, name=name)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"a plugin implements a hook that does not exist: {exc}") from exc
    if os.environ.get("RLHF_TRACE_PLUGINS"):
        pm.trace.root.setwriter(sys.stderr.write)
        pm.enable_tracing()
    return pm


def _a(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


def _skip_hint(dist: str) -> str:
    return f"Fix or uninstall {dist}, or run without it: RLHF_DISABLE_PLUGINS={dist}"


def protocol_problem(seam: str, obj: Any) -> str | None:
    """Why ``obj`` cannot be one of ``seam``'s objects, or None when it has what the seam calls."""
    if seam in CLASS_MEMBERS:
        if not isinstance(obj, type):
            return f"it is {_a(type(obj).__name__)}, not a class"
        members = CLASS_MEMBERS[seam]
    else:
        proto = PROTOCOLS[seam]
        members = sorted(
            set(getattr(proto, "__annotations__", {}))
            | {
                n
                for n, v in vars(proto).items()
                if callable(v) and (n == "__call__" or not n.startswith("_"))
            }
        )
    faults = ["is not callable"] if "__call__" in members and not callable(obj) else []
    if missing := [m for m in members if m != "__call__" and not hasattr(obj, m)]:
        faults.append(f"has no {', '.join(missing)}")
    if not faults:
        return None
    label = getattr(obj, "__qualname__", None)
    got = f"{type(obj).__name__} {label}" if label else type(obj).__name__
    return f"it {' and '.join(faults)} (got {got})"


def collect(pm: pluggy.PluginManager, seam: str) -> dict[str, Registered]:
    """Everything registered for ``seam``, keyed by name. Raises PluginError on a duplicate name."""
    if seam not in SEAMS:
        raise PluginError(f"unknown seam {seam!r}; seams are: {', '.join(SEAMS)}")
    out = {}
    hook = SEAMS[seam]
    for impl in getattr(pm.hook, hook).get_hookimpls():
        plugin_name = pm.get_name(impl.plugin)  # pluggy names every registered plugin
        # not from an entry point: registered directly (a test, or a plugin object passed in code)
        dist, version = pm.rlhf_distributions.get(plugin_name, (f"<{plugin_name}>", ""))
        where = f"{dist} (entry point {plugin_name!r}, hook {hook})"

        def register(
            name: str, obj: Any, _dist: str = dist, _version: str = version, _where: str = where
        ) -> None:
            if not isinstance(name, str) or not name:
                raise PluginError(f"{_where} registered a {seam} entry with an invalid name {name!r}")
            if name in out:
                raise PluginError(
                    f"{seam} name {name!r} is registered twice: by {out[name].distribution} and by {_dist}"
                )
            if problem := protocol_problem(seam, obj):
                what = _a(SINGULAR[seam])
                raise PluginError(
                    f"{_where} registered {name!r} as {what}, but {problem}; "
                    f"docs/plugin-hooks.md says what {what} provides. {_skip_hint(_dist)}"
                )
            out[name] = Registered(seam, name, obj, _dist, _version)

        try:
            impl.function(**{arg: register for arg in impl.argnames})
        except PluginError:
            raise
        except Exception as exc:
            raise PluginError(f"{where} raised {type(exc).__name__}: {exc}. {_skip_hint(dist)}") from exc
    return out


def resolve(pm: pluggy.PluginManager, seam: str, name: str, flag: str | None = None) -> Any:
    """The object registered as ``name`` in ``seam``; a clear error when there is none."""
    found = collect(pm, seam)
    if name in found:
        return found[name].obj
    what = f"{flag} {name}" if flag else repr(name)
    msg = f"no {SINGULAR[seam]} named {name!r} (asked for by {what})."
    if close := difflib.get_close_matches(str(name), list(found), n=1):
        msg += f" Did you mean {close[0]!r}?"
    msg += f" Registered: {', '.join(sorted(found)) or 'none'}."
    if provider := KNOWN_PROVIDERS[seam].get(name):
        msg += f" {name!r} is provided by {provider}: pip install {provider}"
    raise PluginError(msg)


def describe(pm: pluggy.PluginManager) -> list[dict[str, Any]]:
    """One entry per loaded distribution: its version and the names it registered in each seam."""
    dists = {d: {"distribution": d, "version": v, "seams": {}} for d, v in pm.rlhf_distributions.values()}
    for seam in SEAMS:
        for reg in collect(pm, seam).values():
            new = {"distribution": reg.distribution, "version": reg.version, "seams": {}}
            dists.setdefault(reg.distribution, new)["seams"].setdefault(seam, []).append(reg.name)
    return sorted(dists.values(), key=lambda d: d["distribution"])
