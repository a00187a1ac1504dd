"""Tools and their contract.

A tool is a function ``run(args, ctx) -> dict`` with its arguments as a pydantic model, plus
what recovery needs to know about it:

- ``idempotent``: running it twice has the effect of running it once (a human retry of an
  idempotent tool needs no explicit acceptance of a duplicate effect);
- ``read_only``: it changes nothing, so it needs no approval and takes no claim;
- ``sandboxed``: every side effect it has goes through ``ctx.sandbox``. The sandbox is fenced
  by the ledger (``worker.effects``): an execution that was revoked before its commit left
  nothing there, so recovery knows its effect is absent without asking anyone. A tool that
  also talks to the outside world is not sandboxed;
- ``reconcile(args, ctx) -> Evidence | Absent | None``: after a crash, look at the world
  (never change it: the sandbox refuses writes here) and say whether the requested effect
  holds (Evidence), provably does not (Absent), or cannot tell (None: the call stays
  ``unknown`` for a human). A tool that calls a downstream service reconciles by asking that
  service for its receipt under the key it sent with the request (``ctx.service_key``);
- ``auto_retry``: when an execution was revoked and the reconciler proves its effect absent,
  the sweep authorises the next attempt by itself (an event records the evidence). Needs a
  reconciler; off unless the author is sure a late retry is what a user wants;
- ``check(args, ctx)``: refuse unsafe arguments at submit time, before anything is recorded.

What is fenced: the sandbox. What is not: anything else a tool touches. A downstream service
is protected only if it checks the key the tool sends itself (and refuses a key it has seen):
``ctx.service_key``, ``SCOPE/IDEMPOTENCY_KEY``, unique across scopes. ``ctx.idempotency_key``
is unique within its scope only (two conversations' ``call_1`` share ``tool:call_1``); a tool
written against it keeps it until its calls in flight are settled (their attempts went out
under it, and a retry under the other key is a second effect to the service);
a tool may also check ``ctx.lease_lost`` before starting something that cannot be undone.

Mark a function with ``@tool`` in a module named by ``TOOLLEDGER_TOOLS`` or by an entry point
in the ``toolledger.tools`` group; ``toolledger.registry.load_registry`` builds each process's
registry from the built-ins and those modules.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar, get_type_hints

import pydantic

from toolledger.effects import LeaseWatch
from toolledger.ledger.errors import InputError, InvalidArguments, NotFound
from toolledger.ledger.identity import check_registered_name, service_key
from toolledger.ledger.records import EffectState
from toolledger.ledger.transitions import Status
from toolledger.sandbox import Sandbox


class UnknownTool(NotFound):
    """No tool of that name is registered."""


class InvalidToolArguments(InvalidArguments):
    """The arguments do not match the tool's schema."""


class ToolError(Exception):
    """Raised by a tool to report failure: the call ends ``failed`` with this message."""

    def __init__(self, message: str, **detail: Any) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail


class OutcomeUnknown(Exception):
    """Raised by a tool that cannot tell whether its effect happened (e.g. a timeout)."""


@dataclass(frozen=True)
class ToolContext:
    """What a tool may use while it runs (or while it is checked or reconciled)."""

    scope: str
    sandbox: Sandbox
    execution_id: str | None = None
    idempotency_key: str | None = None
    attempt: int = 0
    lease_lost: threading.Event = field(default_factory=threading.Event)
    lease: LeaseWatch | None = None
    #: The ledger's word on executions whose bytes are staged in the sandbox
    #: (``Ledger.effect_states``): a reconciler asking ``Effects.pending_on`` counts only the
    #: bytes of executions running or committed, not a revoked one's, which never land. None
    #: (a context built without a ledger): every staged byte counts.
    effect_states: Callable[[list[str]], dict[str, EffectState]] | None = None

    @property
    def service_key(self) -> str | None:
        """The key to send a service outside the ledger with the request, and to ask it for
        its receipt under: ``SCOPE/IDEMPOTENCY_KEY``, unique across the ledger's scopes
        (``idempotency_key`` is unique within its scope only; a tool switching from it first
        settles its calls in flight). None where there is no call."""
        if self.idempotency_key is None:
            return None
        return service_key(self.scope, self.idempotency_key)


@dataclass(frozen=True)
class Evidence:
    """A reconciler's finding: the state of the world proves this outcome."""

    status: Status
    result: dict[str, Any]
    detail: dict[str, Any]


@dataclass(frozen=True)
class Absent:
    """A reconciler's finding: the requested effect provably does not hold."""

    detail: dict[str, Any]


Finding = Evidence | Absent | None


#: What a tool's own validators and checks raise on arguments they cannot take (pydantic makes
#: a validator's ValueError and AssertionError a ValidationError, and nothing else).
ARGUMENT_ERRORS = (
    TypeError,
    ValueError,
    LookupError,
    AttributeError,
    ArithmeticError,
    AssertionError,
)


def _said(exc: BaseException) -> str:
    """An exception's class and text on one line, at most 500 characters."""
    try:
        text = " ".join(str(exc).split())
    except Exception:  # noqa: BLE001 - a tool's exception class is the tool's code
        text = "(could not be shown)"
    said = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return said if len(said) <= 500 else said[:499] + "…"


A = TypeVar("A", bound=pydantic.BaseModel)
RunFn = Callable[[Any, ToolContext], dict[str, Any]]
ReconcileFn = Callable[[Any, ToolContext], Finding]
CheckFn = Callable[[Any, ToolContext], None]


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    args_model: type[pydantic.BaseModel]
    run: RunFn
    idempotent: bool = False
    read_only: bool = False
    reconcile: ReconcileFn | None = None
    check: CheckFn | None = None
    sandboxed: bool = False
    auto_retry: bool = False

    def __post_init__(self) -> None:
        if self.auto_retry and self.reconcile is None:
            raise TypeError(f"{self.name}: auto_retry needs a reconciler to prove absence")

    def parse(self, args: dict[str, Any]) -> pydantic.BaseModel:
        """Validate ``args`` against the schema; InvalidToolArguments in one line if not.

        A validator of the tool's own model that raises on the model's arguments what pydantic
        does not make a ValidationError (``datetime.fromisoformat(5)``'s TypeError, a KeyError)
        refuses them the same way: it went out as "internal error", exit 1, at submit (an
        exception the agent's client does not expect), for arguments a model may well send."""
        try:
            return self.args_model.model_validate(args)
        except pydantic.ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'args'}: {e['msg']}" for e in exc.errors()
            )
            raise InvalidToolArguments(f"invalid arguments for {self.name}: {problems}") from None
        except ARGUMENT_ERRORS as exc:
            raise InvalidToolArguments(f"invalid arguments for {self.name}: {_said(exc)}") from None

    def refuse(self, args: pydantic.BaseModel, ctx: ToolContext) -> None:
        """The tool's submit-time ``check`` of parsed arguments. Whatever it raises to refuse
        them (an InputError, a ToolError, a ValueError, a KeyError, …) is InvalidToolArguments:
        nothing is recorded, exit 6; other failures (an OSError of the sandbox) go on."""
        if self.check is None:
            return
        try:
            self.check(args, ctx)
        except InputError:
            raise
        except ToolError as exc:
            message = " ".join(exc.message.split()) if isinstance(exc.message, str) else _said(exc)
            raise InvalidToolArguments(f"{self.name} refused its arguments: {message}") from None
        except ARGUMENT_ERRORS as exc:
            raise InvalidToolArguments(f"{self.name} refused its arguments: {_said(exc)}") from None

    def json_schema(self) -> dict[str, Any]:
        schema = self.args_model.model_json_schema()
        schema.pop("title", None)
        return schema

    def definitions(self) -> dict[str, Any]:
        """The tool as OpenAI and Anthropic tool definitions take it, and its contract."""
        schema = self.json_schema()
        return {
            "name": self.name,
            "description": self.description,
            "idempotent": self.idempotent,
            "read_only": self.read_only,
            "reconcilable": self.reconcile is not None,
            "sandboxed": self.sandboxed,
            "auto_retry": self.auto_retry,
            "openai": {
                "type": "function",
                "function": {
                    "name": self.name,
                    "description": self.description,
                    "parameters": schema,
                },
            },
            "anthropic": {
                "name": self.name,
                "description": self.description,
                "input_schema": schema,
            },
        }


def make_tool(
    fn: Callable[[A, ToolContext], dict[str, Any]],
    *,
    name: str | None = None,
    description: str | None = None,
    idempotent: bool = False,
    read_only: bool = False,
    reconcile: Callable[[A, ToolContext], Finding] | None = None,
    check: Callable[[A, ToolContext], None] | None = None,
    sandboxed: bool = False,
    auto_retry: bool = False,
) -> Tool:
    """A Tool from a function whose first parameter is annotated with its args model."""
    params = list(inspect.signature(fn).parameters)
    model = get_type_hints(fn).get(params[0]) if params else None
    if not (isinstance(model, type) and issubclass(model, pydantic.BaseModel)):
        raise TypeError(f"{fn.__name__}: annotate the first parameter with a pydantic model")
    return Tool(
        name=name or fn.__name__,
        description=_prose(description or fn.__doc__ or ""),
        args_model=model,
        run=fn,
        idempotent=idempotent,
        read_only=read_only,
        reconcile=reconcile,
        check=check,
        sandboxed=sandboxed,
        auto_retry=auto_retry,
    )


def _prose(doc: str) -> str:
    """A docstring as a model reads it best: lines folded within each paragraph."""
    paragraphs = inspect.cleandoc(doc).split("\n\n")
    return "\n\n".join(" ".join(p.split()) for p in paragraphs if p.strip())


class Registry:
    """Tools by name."""

    def __init__(self, tools: list[Tool] | None = None) -> None:
        self._tools: dict[str, Tool] = {}
        for t in tools or []:
            self.register(t)

    def register(self, t: Tool) -> Tool:
        check_registered_name(t.name)
        existing = self._tools.get(t.name)
        if existing is not None and existing is not t and existing.run is not t.run:
            raise ValueError(f"a different tool named {t.name!r} is already registered")
        self._tools[t.name] = t
        return t

    def get(self, name: str) -> Tool:
        try:
            return self._tools[name]
        except KeyError:
            known = ", ".join(sorted(self._tools)) or "none"
            raise UnknownTool(f"unknown tool {name!r}; registered: {known}") from None

    def __iter__(self) -> Iterator[Tool]:
        return iter(sorted(self._tools.values(), key=lambda t: t.name))

    def __contains__(self, name: object) -> bool:
        return name in self._tools


#: Where ``@tool`` leaves the Tool it made, on the function itself.
TOOL_ATTRIBUTE = "__toolledger_tool__"


def tool(**options: Any) -> Callable[[RunFn], RunFn]:
    """Decorator: ``@tool(idempotent=True, reconcile=...)`` makes the function a tool.

    Nothing global changes: the Tool is kept on the function, and ``load_registry`` finds it
    when it loads the function's module (by ``TOOLLEDGER_TOOLS`` or an entry point).
    """

    def decorate(fn: RunFn) -> RunFn:
        setattr(fn, TOOL_ATTRIBUTE, make_tool(fn, **options))
        return fn

    return decorate


def tools_in(namespace: dict[str, Any]) -> list[Tool]:
    """The tools a module defines: functions marked by ``@tool`` and Tool objects."""
    found: list[Tool] = []
    for value in namespace.values():
        marked = getattr(value, TOOL_ATTRIBUTE, None)
        if isinstance(marked, Tool):
            found.append(marked)
        elif isinstance(value, Tool):
            found.append(value)
    return found
