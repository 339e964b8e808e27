"""`moe_lab.registry.Registry`: what a registry says about itself, and about an unknown name."""

import pytest

from moe_lab.registry import PLUGIN_HINT, Registry


def test_an_unknown_name_is_refused_with_the_names_and_what_the_registry_holds():
    reg = Registry("widget", "things that spin")
    reg.register("top", object())
    with pytest.raises(ValueError, match=r"^w must be one of \['top'\], got 'yo'; widget registry: "
                                         "things that spin$"):
        reg.lookup("yo", "w")
    assert repr(reg) == "<widget registry: things that spin; names ['top']>"


def test_only_a_registry_the_plugin_adds_to_says_so():
    plain, extended = Registry("a", "as"), Registry("b", "bs", plugin=True)
    with pytest.raises(ValueError) as err:
        plain.lookup("x", "a")
    assert PLUGIN_HINT not in str(err.value)
    with pytest.raises(ValueError, match=PLUGIN_HINT.replace("(", r"\(").replace(")", r"\)")):
        extended.lookup("x", "b")
    extended.unavailable["x"] = "no C++ compiler"
    with pytest.raises(ValueError, match=r"'x' is not available here: no C\+\+ compiler") as err:
        extended.lookup("x", "b")
    assert PLUGIN_HINT not in str(err.value)  # the plug-in tried: its reason is the hint
    extended.register("x", 1)
    assert extended.lookup("x", "b") == 1 and not extended.unavailable


def test_a_name_registered_with_what_is_missing_is_refused_with_the_reason():
    registry = Registry("widget", "widgets")
    fn = registry.register("fast", print, missing="it needs Triton, which installs on Linux only")
    assert fn is print and "fast" not in registry  # the decorator form still returns the function
    with pytest.raises(ValueError, match=r"'fast' is not available here: it needs Triton") as err:
        registry.lookup("fast", "widget_impl")
    assert str(err.value).startswith("widget_impl must be one of [], got 'fast'")
    registry.register("fast", print, missing=None)
    assert registry.lookup("fast", "widget_impl") is print


def test_the_core_registries_describe_themselves_and_only_the_plugins_say_it_adds_names():
    from moe_lab.attention import ATTENTION_IMPLS, PACKED_ATTENTION_IMPLS
    from moe_lab.model import EMBEDDING_IMPLS
    from moe_lab.moe.dispatch import DISPATCHERS
    from moe_lab.moe.experts import EXPERT_BACKENDS, EXPERT_KINDS
    from moe_lab.moe.router import ROUTER_IMPLS
    from moe_lab.training.optim import CLIP_STEPS

    extended = [ATTENTION_IMPLS, PACKED_ATTENTION_IMPLS, EMBEDDING_IMPLS,
                EXPERT_BACKENDS, ROUTER_IMPLS, CLIP_STEPS]  # moe_lab.workbench.cpu.register's
    for registry in [*extended, DISPATCHERS, EXPERT_KINDS]:
        assert registry.description, registry.kind
        assert registry.plugin == (registry in extended), registry.kind


def test_every_registry_of_the_lesson_says_what_it_holds():
    import importlib
    import pkgutil

    import moe_lab

    found = {}
    for info in pkgutil.walk_packages(moe_lab.__path__, "moe_lab."):
        if info.name.startswith("moe_lab.workbench") or info.name == "moe_lab.__main__":
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if isinstance(value, Registry):
                found[f"{info.name}.{name}"] = value
    assert len({id(r) for r in found.values()}) >= 9, sorted(found)
    silent = sorted(name for name, registry in found.items() if not registry.description)
    assert not silent, f"registries without a description: {silent}"
