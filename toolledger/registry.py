"""Each process's registry: the built-in tools, then the tools of the modules named.

A registry is built, never shared: ``load_registry`` returns a new one each call, so two
runtimes in one process (or a test) cannot see each other's tools.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from types import ModuleType

from toolledger.builtin_tools import BUILTINS
from toolledger.tools import Registry, tools_in

ENTRY_POINT_GROUP = "toolledger.tools"


def load_registry(modules: str = "", *, use_entry_points: bool = True) -> Registry:
    """A new registry: the built-ins, the tools of the modules named (comma-separated, as in
    ``TOOLLEDGER_TOOLS``) and of the ``toolledger.tools`` entry points."""
    registry = Registry(list(BUILTINS))
    for name in filter(None, (m.strip() for m in modules.split(","))):
        for t in tools_in(vars(importlib.import_module(name))):
            registry.register(t)
    if use_entry_points:
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            loaded = ep.load()  # a module, a tool, or a function register(registry)
            found = tools_in(vars(loaded) if isinstance(loaded, ModuleType) else {"": loaded})
            for t in found:
                registry.register(t)
            if not found and callable(loaded) and not isinstance(loaded, type):
                loaded(registry)
    return registry
