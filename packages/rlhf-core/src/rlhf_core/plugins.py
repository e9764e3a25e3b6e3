"""Loading plugins and looking up what they registered.

``get_plugin_manager()`` builds a fresh manager each call (no module-level singleton): tests and Ray
actors get their own, and actors receive plugin *names*, never a pickled manager.

Environment variables:

- ``RLHF_LOAD_PLUGINS=dist-a,dist-b``: load only these distributions from the ``rlhf`` entry-point group
  (an empty value loads none).
- ``RLHF_DISABLE_PLUGINS=dist-a,dist-b``: skip these distributions (entry-point names work too).
- ``RLHF_TRACE_PLUGINS=1``: print every hook call and its result.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys
from dataclasses import dataclass
from typing import Any

import pluggy

from rlhf_core import hookspecs

ENTRY_POINT_GROUP = hookspecs.PROJECT

# seam -> hook name. The order is the order ``rlhf plugins`` prints.
SEAMS: dict[str, str] = {
    "advantage_estimators": "rlhf_register_advantage_estimators",
    "policy_losses": "rlhf_register_policy_losses",
    "kl_estimators": "rlhf_register_kl_estimators",
    "agent_executors": "rlhf_register_agent_executors",
    "environments": "rlhf_register_environments",
    "reward_sources": "rlhf_register_reward_sources",
    "post_processors": "rlhf_register_post_processors",
    "placement_strategies": "rlhf_register_placement_strategies",
    "rollout_engines": "rlhf_register_rollout_engines",
    "train_backends": "rlhf_register_train_backends",
}

SINGULAR = {
    "advantage_estimators": "advantage estimator",
    "policy_losses": "policy loss",
    "kl_estimators": "KL estimator",
    "agent_executors": "agent executor",
    "environments": "environment",
    "reward_sources": "reward source",
    "post_processors": "post-processor",
    "placement_strategies": "placement strategy",
    "rollout_engines": "rollout engine",
    "train_backends": "train backend",
}

# Names the first-party packages register, so that asking for one that is missing says what to install.
KNOWN_PROVIDERS: dict[str, dict[str, str]] = {
    "advantage_estimators": dict.fromkeys(
        ["gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "dr_grpo"], "rlhf-algos"
    ),
    "policy_losses": dict.fromkeys(["ppo", "gspo"], "rlhf-algos"),
    "kl_estimators": dict.fromkeys(["k1", "k2", "k3"], "rlhf-algos"),
    "agent_executors": dict.fromkeys(["single_turn", "multi_turn", "openai_server"], "rlhf-agents"),
    "environments": {},
    "reward_sources": dict.fromkeys(["python_file", "http", "reward_model"], "rlhf-agents"),
    "post_processors": dict.fromkeys(["rs", "iter_dpo", "csft"], "rlhf-core"),
    "placement_strategies": dict.fromkeys(
        ["colocate_all", "colocate_actor_ref", "colocate_critic_reward", "separate"], "rlhf-cli"
    ),
    "rollout_engines": {"hf": "rlhf-core", "vllm": "rlhf-rollout-vllm[vllm]"},
    "train_backends": {"deepspeed": "rlhf-train-deepspeed"},
}


# Plugins registered for the duration of one test by the `register_plugin` fixture of rlhf_core.testing.
_TEST_PLUGINS: list[tuple[str, object]] = []


class PluginError(Exception):
    """A plugin could not be loaded, registered a duplicate, or a requested name is missing."""


@dataclass(frozen=True)
class Registered:
    """One object a plugin registered, with where it came from."""

    seam: str
    name: str
    obj: Any
    distribution: str
    version: str


def _env_list(var: str) -> list[str] | None:
    value = os.environ.get(var)
    if value is None:
        return None
    return [x.strip() for x in value.split(",") if x.strip()]


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-")


def get_plugin_manager(load_entrypoints: bool = True) -> pluggy.PluginManager:
    """A new plugin manager with the hookspecs added and the ``rlhf`` entry points loaded.

    Honours ``RLHF_LOAD_PLUGINS`` and ``RLHF_DISABLE_PLUGINS`` (see the module docstring), then runs
    ``check_pending()`` so that a misspelled hook implementation fails here rather than being ignored.
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    # plugin name -> (distribution, version), for provenance in `rlhf plugins` and run metadata
    pm.rlhf_distributions = {}
    if load_entrypoints:
        only = _env_list("RLHF_LOAD_PLUGINS")
        blocked = {_normalise(x) for x in (_env_list("RLHF_DISABLE_PLUGINS") or [])}
        for ep in md.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist is not None else ep.name
            keys = {_normalise(dist), _normalise(ep.name)}
            if keys & blocked:
                continue
            if only is not None and not keys & {_normalise(x) for x in only}:
                continue
            if pm.get_plugin(ep.name) is not None:
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken third-party plugin must say who it is
                raise PluginError(
                    f"could not load rlhf plugin {ep.name!r} ({ep.value}) from distribution {dist!r}: "
                    f"{type(exc).__name__}: {exc}"
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


def _distribution_of(pm: pluggy.PluginManager, plugin: object) -> tuple[str, str]:
    name = pm.get_name(plugin) or getattr(plugin, "__name__", repr(plugin))
    dists = getattr(pm, "rlhf_distributions", {})
    if name in dists:
        return dists[name]
    return f"<{name}>", ""  # registered directly (a test, or a plugin object passed in code)


def collect(pm: pluggy.PluginManager, seam: str) -> dict[str, Registered]:
    """Everything registered for ``seam``, keyed by name. Raises PluginError on a duplicate name."""
    if seam not in SEAMS:
        raise PluginError(f"unknown seam {seam!r}; seams are: {', '.join(SEAMS)}")
    out: dict[str, Registered] = {}
    for impl in getattr(pm.hook, SEAMS[seam]).get_hookimpls():
        dist, version = _distribution_of(pm, impl.plugin)

        def register(name: str, obj: Any, _dist: str = dist, _version: str = version) -> None:
            if not isinstance(name, str) or not name:
                raise PluginError(f"{_dist} registered a {seam} entry with an invalid name {name!r}")
            if name in out:
                raise PluginError(
                    f"{seam} name {name!r} is registered twice: by {out[name].distribution} and by {_dist}"
                )
            out[name] = Registered(seam, name, obj, _dist, _version)

        impl.function(**{arg: register for arg in impl.argnames})
    return out


def resolve(pm: pluggy.PluginManager, seam: str, name: str, flag: str | None = None) -> Any:
    """The object registered as ``name`` in ``seam``; a clear error when there is none."""
    found = collect(pm, seam)
    if name in found:
        return found[name].obj
    what = f"{flag} {name}" if flag else repr(name)
    known = ", ".join(sorted(found)) or "none"
    msg = f"no {SINGULAR[seam]} named {name!r} (asked for by {what}). Registered: {known}."
    provider = KNOWN_PROVIDERS.get(seam, {}).get(name)
    if provider:
        msg += f" {name!r} is provided by {provider}: pip install {provider}"
    raise PluginError(msg)


def describe(pm: pluggy.PluginManager) -> list[dict[str, Any]]:
    """One entry per loaded distribution: its version and the names it registered in each seam."""
    dists: dict[str, dict[str, Any]] = {}
    for dist, version in getattr(pm, "rlhf_distributions", {}).values():
        dists.setdefault(dist, {"distribution": dist, "version": version, "seams": {}})
    for seam in SEAMS:
        for reg in collect(pm, seam).values():
            entry = dists.setdefault(
                reg.distribution, {"distribution": reg.distribution, "version": reg.version, "seams": {}}
            )
            entry["seams"].setdefault(seam, []).append(reg.name)
    return sorted(dists.values(), key=lambda d: d["distribution"])
