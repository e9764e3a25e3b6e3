"""The plugin manager: discovery filters, duplicates, misspelled hooks, lookups and their errors."""

import pytest

from rlhf_core import hookimpl, plugins
from rlhf_core.plugins import PluginError, collect, get_plugin_manager, resolve


class Alpha:
    @staticmethod
    @hookimpl
    def rlhf_register_advantage_estimators(register):
        register("alpha_est", object())


class AlphaAgain:
    @staticmethod
    @hookimpl
    def rlhf_register_advantage_estimators(register):
        register("alpha_est", object())


class Misspelled:
    @staticmethod
    @hookimpl
    def rlhf_register_advantage_estimator(register):  # no such hook: the "s" is missing
        register("x", object())


def test_a_fresh_manager_each_call():
    assert get_plugin_manager() is not get_plugin_manager()


def test_registered_plugin_is_seen_and_removed_after(register_plugin):
    register_plugin(Alpha, name="alpha-plugin")
    found = collect(get_plugin_manager(load_entrypoints=False), "advantage_estimators")
    assert found["alpha_est"].distribution == "<alpha-plugin>"


def test_fixture_cleans_up():
    assert plugins._TEST_PLUGINS == []


def test_duplicate_name_names_both_sources(register_plugin):
    register_plugin(Alpha, name="first")
    register_plugin(AlphaAgain, name="second")
    with pytest.raises(PluginError, match="'alpha_est' is registered twice: by <(first|second)> and by <(first|second)>"):
        collect(get_plugin_manager(load_entrypoints=False), "advantage_estimators")


def test_duplicate_with_an_installed_distribution_names_it(register_plugin):
    class Shadow:
        @staticmethod
        @hookimpl
        def rlhf_register_advantage_estimators(register):
            register("gae", object())

    register_plugin(Shadow, name="shadow")
    with pytest.raises(PluginError, match="'gae' is registered twice: by rlhf-algos and by <shadow>"):
        collect(get_plugin_manager(), "advantage_estimators")


def test_misspelled_hook_fails_at_load(register_plugin):
    register_plugin(Misspelled, name="typo")
    with pytest.raises(PluginError, match="rlhf_register_advantage_estimator"):
        get_plugin_manager(load_entrypoints=False)


def test_resolve_error_lists_names_and_install_hint(register_plugin):
    register_plugin(Alpha, name="alpha-plugin")
    pm = get_plugin_manager(load_entrypoints=False)
    with pytest.raises(PluginError) as err:
        resolve(pm, "advantage_estimators", "group_norm", "--algo.advantage.estimator")
    msg = str(err.value)
    assert "no advantage estimator named 'group_norm' (asked for by --algo.advantage.estimator group_norm)" in msg
    assert "Registered: alpha_est." in msg and "pip install rlhf-algos" in msg
    with pytest.raises(PluginError, match="Registered: none"):
        resolve(pm, "policy_losses", "mine")


def test_load_and_disable_filters(monkeypatch):
    monkeypatch.setenv("RLHF_LOAD_PLUGINS", "rlhf-algos")
    assert {d for d, _ in get_plugin_manager().rlhf_distributions.values()} == {"rlhf-algos"}
    monkeypatch.setenv("RLHF_LOAD_PLUGINS", "")
    assert get_plugin_manager().rlhf_distributions == {}
    monkeypatch.delenv("RLHF_LOAD_PLUGINS")
    monkeypatch.setenv("RLHF_DISABLE_PLUGINS", "rlhf_algos, rlhf-cli")  # entry-point or distribution names
    loaded = {d for d, _ in get_plugin_manager().rlhf_distributions.values()}
    assert "rlhf-algos" not in loaded and "rlhf-cli" not in loaded and "rlhf-core" in loaded


def test_broken_plugin_names_its_distribution(monkeypatch):
    import importlib.metadata as md

    class BrokenEP:
        name, value, group = "broken", "no_such_module_xyz", "rlhf"

        class dist:  # noqa: N801 - stands in for importlib.metadata.Distribution
            name, version = "broken-dist", "9.9"

        def load(self):
            import no_such_module_xyz  # noqa: F401

    real = md.entry_points
    monkeypatch.setattr(md, "entry_points", lambda group: [BrokenEP()] if group == "rlhf" else real(group=group))
    with pytest.raises(PluginError, match="'broken'.*distribution 'broken-dist'.*ModuleNotFoundError"):
        get_plugin_manager()


def test_describe_reports_versions_and_seams():
    info = {d["distribution"]: d for d in plugins.describe(get_plugin_manager())}
    assert info["rlhf-core"]["version"] == "0.1.0"
    assert "rollout_engines" in info["rlhf-core"]["seams"]
