"""The plugin manager: discovery filters, duplicates, misspelled hooks, lookups and their errors."""

import pytest

from rlhf_core import hookimpl, plugins
from rlhf_core.plugins import PluginError, collect, get_plugin_manager, resolve


class Estimator:
    """Has what the advantage-estimator seam calls (never called here)."""

    needs_critic = False
    min_samples_per_prompt = 1

    def __call__(self, batch):
        raise NotImplementedError


class Alpha:
    @staticmethod
    @hookimpl
    def rlhf_register_advantage_estimators(register):
        register("alpha_est", Estimator())


class AlphaAgain:
    @staticmethod
    @hookimpl
    def rlhf_register_advantage_estimators(register):
        register("alpha_est", Estimator())


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
    with pytest.raises(
        PluginError, match="'alpha_est' is registered twice: by <(first|second)> and by <(first|second)>"
    ):
        collect(get_plugin_manager(load_entrypoints=False), "advantage_estimators")


def test_duplicate_with_an_installed_distribution_names_it(register_plugin):
    class Shadow:
        @staticmethod
        @hookimpl
        def rlhf_register_advantage_estimators(register):
            register("gae", Estimator())

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
    assert (
        "no advantage estimator named 'group_norm' (asked for by --algo.advantage.estimator group_norm)"
        in msg
    )
    assert "Registered: alpha_est." in msg and "pip install rlhf-algos" in msg
    assert "Did you mean" not in msg  # nothing close to group_norm is registered
    with pytest.raises(PluginError, match="Registered: none"):
        resolve(pm, "policy_losses", "mine")


def test_a_misspelled_name_gets_a_suggestion():
    pm = get_plugin_manager()
    with pytest.raises(PluginError, match="named 'grpo_norm' .* Did you mean 'group_norm'"):
        resolve(pm, "advantage_estimators", "grpo_norm", "--algo.advantage.estimator")
    with pytest.raises(PluginError, match="Did you mean 'guess_number'"):
        resolve(pm, "environments", "guess_numbr", "--train.env")


def test_an_object_that_does_not_fit_its_seam_is_refused_naming_its_plugin(register_plugin):
    """A plain function is not an estimator (no needs_critic / min_samples_per_prompt): refused when it is
    registered, before any run starts, instead of an AttributeError in a worker."""

    def group_median(batch):
        raise NotImplementedError

    class FunctionAsEstimator:
        @staticmethod
        @hookimpl
        def rlhf_register_advantage_estimators(register):
            register("group_median", group_median)

    class InstanceAsEnvironment:
        @staticmethod
        @hookimpl
        def rlhf_register_environments(register):
            register("env", object())

    class LambdaAsPlacement:
        @staticmethod
        @hookimpl
        def rlhf_register_placement_strategies(register):
            register("mine", lambda roles, cfg, gpus: None)

    register_plugin(FunctionAsEstimator, name="median-plugin")
    register_plugin(InstanceAsEnvironment, name="env-plugin")
    register_plugin(LambdaAsPlacement, name="placement-plugin")
    pm = get_plugin_manager(load_entrypoints=False)
    with pytest.raises(PluginError) as err:
        collect(pm, "advantage_estimators")
    assert str(err.value) == (
        "<median-plugin> (entry point 'median-plugin', hook rlhf_register_advantage_estimators) registered "
        "'group_median' as an advantage estimator, but it has no min_samples_per_prompt, needs_critic (got "
        "function test_an_object_that_does_not_fit_its_seam_is_refused_naming_its_plugin.<locals>.group_median); "
        "docs/plugin-hooks.md says what an advantage estimator provides. Fix or uninstall <median-plugin>, or "
        "run without it: RLHF_DISABLE_PLUGINS=<median-plugin>"
    )
    with pytest.raises(
        PluginError, match="registered 'env' as an environment, but it is an object, not a class"
    ):
        collect(pm, "environments")
    with pytest.raises(PluginError, match="registered 'mine' as a placement strategy, but it has no plan"):
        collect(pm, "placement_strategies")


def _fake_entry_point(monkeypatch, plugin):
    """``plugin`` as the entry point 'hooks' of an installed distribution 'shaky-dist'."""
    import importlib.metadata as md

    class EntryPoint:
        name, value, group = "hooks", "shaky.hooks", "rlhf"

        class dist:  # noqa: N801 - stands in for importlib.metadata.Distribution
            name, version = "shaky-dist", "1.0"

        def load(self):
            return plugin

    real = md.entry_points
    monkeypatch.setattr(
        md, "entry_points", lambda group: [EntryPoint()] if group == "rlhf" else real(group=group)
    )


def test_a_hook_that_raises_names_the_distribution_entry_point_and_how_to_skip_it(monkeypatch):
    class Shaky:
        @staticmethod
        @hookimpl
        def rlhf_register_environments(register):
            raise KeyError("MY_ENV_HOME")

    _fake_entry_point(monkeypatch, Shaky)
    pm = get_plugin_manager()
    with pytest.raises(PluginError) as err:
        collect(pm, "environments")
    assert str(err.value) == (
        "shaky-dist (entry point 'hooks', hook rlhf_register_environments) raised KeyError: 'MY_ENV_HOME'. "
        "Fix or uninstall shaky-dist, or run without it: RLHF_DISABLE_PLUGINS=shaky-dist"
    )
    assert isinstance(err.value.__cause__, KeyError)  # the traceback is kept for --debug and the log
    monkeypatch.setenv("RLHF_DISABLE_PLUGINS", "shaky-dist")  # what the message suggests works
    assert collect(get_plugin_manager(), "environments") == {}


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
    monkeypatch.setattr(
        md, "entry_points", lambda group: [BrokenEP()] if group == "rlhf" else real(group=group)
    )
    with pytest.raises(
        PluginError,
        match="'broken'.*distribution 'broken-dist'.*ModuleNotFoundError.*RLHF_DISABLE_PLUGINS=broken-dist",
    ):
        get_plugin_manager()


def test_describe_reports_versions_and_seams():
    info = {d["distribution"]: d for d in plugins.describe(get_plugin_manager())}
    assert info["rlhf-core"]["version"] == "0.1.0"
    assert "rollout_engines" in info["rlhf-core"]["seams"]


def test_every_seam_has_a_registration_check():
    """A seam added without a protocol would fail every registration with a KeyError."""
    assert set(plugins.SEAMS) == set(plugins.PROTOCOLS) | set(plugins.CLASS_MEMBERS)
    assert set(plugins.SEAMS) == set(plugins.SINGULAR) == set(plugins.KNOWN_PROVIDERS)
