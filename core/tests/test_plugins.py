"""The registry's rules, with in-process plugin modules (installed plugins: test_installed_plugins.py)."""

import re
import types

import pytest

from blockzoo.api import MixerConfig, NormalizationConfig, PluginInfo, configclass, hookimpl
from blockzoo.config import UnknownTypeError
from blockzoo.plugins import PLUGIN_API, PluginRecord, Registry


@configclass
class AlphaMixerConfig(MixerConfig):
    pass


@configclass
class BetaMixerConfig(MixerConfig):
    pass


@configclass
class OddNormalizationConfig(NormalizationConfig):
    pass


def plugin_module(**hooks) -> types.ModuleType:
    module = types.ModuleType("fake_plugin")
    for name, function in hooks.items():
        setattr(module, name, hookimpl(specname=name)(function))
    return module


def load(registry: Registry, name: str, distribution: str | None = None, version: str = "1.0", **hooks) -> PluginRecord:
    record = PluginRecord(name=name, distribution=distribution, version=version if distribution else None)
    registry.add_plugin(plugin_module(**hooks), record)
    return record


def test_a_working_plugin_registers_its_types():
    registry = Registry()
    record = load(
        registry,
        "acme",
        "blockzoo-acme",
        register_mixers=lambda register: register("acme.alpha", AlphaMixerConfig, "acme.mixer:Alpha"),
        plugin_info=lambda: PluginInfo(capabilities=("tensor_parallel",)),
    )
    assert record.status == "loaded" and record.types == {"mixer": ["acme.alpha"]}
    entry = registry.resolve("mixer", "acme.alpha")
    assert entry.config_class is AlphaMixerConfig and entry.plugin is record
    assert registry.name_of(AlphaMixerConfig) == "acme.alpha"
    assert record.to_dict()["capabilities"] == ["tensor_parallel"]


def test_third_party_types_carry_the_plugin_name():
    registry = Registry()
    record = load(
        registry,
        "acme",
        "blockzoo-acme",
        register_mixers=lambda register: (register("acme.alpha", AlphaMixerConfig), register("beta", BetaMixerConfig)),
    )
    assert record.status == "failed"
    assert "'beta' must be 'acme.<name>'" in record.error
    # Nothing of a failed plugin stays registered, not even what it registered before failing.
    assert registry.available("mixer") == []
    with pytest.raises(UnknownTypeError, match=re.escape("plugin 'acme' (blockzoo-acme 1.0) failed to load")):
        registry.resolve("mixer", "acme.alpha")


def test_first_party_types_are_plain():
    registry = Registry()
    record = load(
        registry, "attention", "blockzoo-attention", register_mixers=lambda register: register("x.y", AlphaMixerConfig)
    )
    assert record.status == "failed" and "lowercase letters" in record.error


def test_each_hook_registers_its_own_kinds():
    registry = Registry()
    record = load(
        registry, "acme", "blockzoo-acme", register_mixers=lambda register: register("acme.odd", OddNormalizationConfig)
    )
    assert record.status == "failed"
    assert "register_mixers registered 'acme.odd' of kind 'normalization'; register it from register_components" in (
        record.error
    )
    record = load(
        registry, "other", "blockzoo-other", register_components=lambda register: register("other.a", AlphaMixerConfig)
    )
    assert record.status == "failed" and "register it from register_mixers" in record.error
    record = load(registry, "third", "blockzoo-third", register_mixers=lambda register: register("third.x", dict))
    assert record.status == "failed" and "not a subclass of a config kind" in record.error


def test_duplicate_names_are_an_error_naming_both_distributions():
    registry = Registry()
    first = load(
        registry,
        "dup",
        "blockzoo-dup-one",
        "1.0.0",
        register_mixers=lambda register: register("dup.m", AlphaMixerConfig),
    )
    second = load(
        registry,
        "dup",
        "blockzoo-dup-two",
        "2.0.0",
        register_mixers=lambda register: register("dup.m", BetaMixerConfig),
    )
    assert first.conflicts == second.conflicts == ["mixer:dup.m"]
    with pytest.raises(UnknownTypeError) as caught:
        registry.resolve("mixer", "dup.m")
    message = str(caught.value)
    assert "blockzoo-dup-one 1.0.0" in message and "blockzoo-dup-two 2.0.0" in message
    assert not registry.is_registered(AlphaMixerConfig) and not registry.is_registered(BetaMixerConfig)
    assert any("registered by both" in line for line in registry.problems())


def test_plugin_api_version_handshake():
    registry = Registry()
    newer = load(registry, "new", "blockzoo-new", plugin_info=lambda: PluginInfo(api_version=(1, 99)))
    other = load(registry, "old", "blockzoo-old", plugin_info=lambda: PluginInfo(api_version=(0, 3)))
    fine = load(registry, "fine", "blockzoo-fine", plugin_info=lambda: PluginInfo(api_version=(1, 0)))
    assert newer.status == other.status == "incompatible"
    assert newer.error == f"written for plugin API 1.99; this blockzoo provides {PLUGIN_API[0]}.{PLUGIN_API[1]}"
    assert fine.status == "loaded"
    bad = load(registry, "bad", "blockzoo-bad", plugin_info=lambda: {"api_version": "1.0"})
    assert bad.status == "failed" and "must return blockzoo.api.PluginInfo" in bad.error


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"api_version": "1.0"}, "PluginInfo(api_version='1.0'): give (major, minor) as two ints, e.g. api_version="),
        ({"api_version": (1,)}, "PluginInfo(api_version=(1,)): give (major, minor) as two ints"),
        ({"api_version": (1, 0.5)}, "PluginInfo(api_version=(1, 0.5)): give (major, minor) as two ints"),
        ({"capabilities": "tensor_parallel"}, "PluginInfo(capabilities='tensor_parallel'): give a tuple of"),
    ],
)
def test_a_malformed_plugin_info_fails_the_plugin_with_what_to_write(fields, expected):
    registry = Registry()
    record = load(registry, "odd", "blockzoo-odd", plugin_info=lambda: PluginInfo(**fields))
    assert record.status == "failed" and expected in record.error, record.error
    assert "..." not in record.error


def test_broken_hooks_fail_the_plugin_not_the_host():
    registry = Registry()

    def explode(register):
        register("acme.alpha", AlphaMixerConfig)
        raise RuntimeError("no kernels")

    broken = load(registry, "acme", "blockzoo-acme", register_mixers=explode)
    raised_at = f"{__file__}:{explode.__code__.co_firstlineno + 2}"  # the raise: the error says where it happened
    assert broken.status == "failed" and broken.error == f"RuntimeError: no kernels ({raised_at})"
    assert broken.traceback.startswith("Traceback") and 'raise RuntimeError("no kernels")' in broken.traceback
    typo = load(registry, "typo", "blockzoo-typo", register_mixer=lambda register: None)
    assert typo.status == "failed" and "register_mixer" in typo.error  # pluggy: unknown hook
    wrong_signature = load(registry, "sig", "blockzoo-sig", register_mlps=lambda register, extra: None)
    assert wrong_signature.status == "failed" and "extra" in wrong_signature.error
    good = load(
        registry, "good", "blockzoo-good", register_mixers=lambda register: register("good.beta", BetaMixerConfig)
    )
    assert good.status == "loaded" and registry.available("mixer") == ["good.beta"]
    assert sorted(line.split()[1] for line in registry.problems()) == ["'acme'", "'sig'", "'typo'"]


def test_implementation_must_name_module_and_attribute():
    registry = Registry()
    record = load(
        registry, "acme", "blockzoo-acme", register_mixers=lambda register: register("acme.a", AlphaMixerConfig, "acme")
    )
    assert record.status == "failed" and "must be 'module:attribute'" in record.error
    record = load(
        registry, "ok", "blockzoo-ok", register_mixers=lambda register: register("ok.a", AlphaMixerConfig, "json:dumps")
    )
    import json

    assert registry.resolve("mixer", "ok.a").load_implementation() is json.dumps
