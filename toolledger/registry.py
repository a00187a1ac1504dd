"""Each process's registry: the built-in tools, then the tools of the modules named.

A registry is built, never shared: ``load_registry`` returns a new one each call, so two
runtimes in one process (or a test) cannot see each other's tools.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import partial
from importlib.metadata import entry_points
from types import ModuleType
from typing import Any

from toolledger.builtin_tools import BUILTINS
from toolledger.config import ConfigError
from toolledger.ledger.errors import InputError
from toolledger.tools import Registry, Tool, tools_in

ENTRY_POINT_GROUP = "toolledger.tools"


def load_registry(modules: str = "", *, use_entry_points: bool = True) -> Registry:
    """A new registry: the built-ins, the tools of the modules named (comma-separated, as in
    ``TOOLLEDGER_TOOLS``) and of the ``toolledger.tools`` entry points.

    Anything that goes wrong here is a configuration error (exit 2, one line), never a
    worker that starts and then fails every job: a module that does not import (whatever it
    raises, ``SystemExit`` included), two different tools under one name (a built-in's
    included)."""
    registry = Registry(list(BUILTINS))
    for name in filter(None, (m.strip() for m in modules.split(","))):
        module = _load(f"TOOLLEDGER_TOOLS: module {name!r}", partial(importlib.import_module, name))
        _register(registry, tools_in(vars(module)), f"module {name!r}")
    if use_entry_points:
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            where = f"entry point {ep.name!r} ({ep.value})"
            loaded = _load(where, ep.load)  # a module, a tool, or a function register(registry)
            found = tools_in(vars(loaded) if isinstance(loaded, ModuleType) else {"": loaded})
            _register(registry, found, where)
            if not found and callable(loaded) and not isinstance(loaded, type):
                _load(where, partial(loaded, registry))
    return registry


def _load(where: str, load: Callable[[], Any]) -> Any:
    try:
        return load()
    except (KeyboardInterrupt, ConfigError):
        raise
    except BaseException as exc:  # noqa: BLE001 - SystemExit too: a tool module may not exit us
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise ConfigError(f"{where} failed to load: {' '.join(detail.split())}") from None


def _register(registry: Registry, found: list[Tool], where: str) -> None:
    for t in found:
        try:
            registry.register(t)
        except (ValueError, InputError) as exc:  # a taken name, or one no tool may take
            raise ConfigError(f"{where}: {exc}") from None
