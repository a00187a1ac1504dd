"""Settings: one object, read from the environment at the edge (CLI, app factory) only."""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from toolledger.ledger.identity import MAX_ARGS_BYTES

PREFIX = "TOOLLEDGER_"
#: Where the embedded default keeps its files (the ledger, the broker, the sandbox).
DEFAULT_HOME = Path(".toolledger")


class ConfigError(ValueError):
    """A setting is missing, malformed or inconsistent with another."""


class Settings:
    """Everything toolledger can be told, with its default.

    home                where the embedded default keeps its files (TOOLLEDGER_HOME, ./.toolledger)
    db                  ledger URL (TOOLLEDGER_DB; default SQLite at HOME/ledger.db)
    broker              Celery broker URL (TOOLLEDGER_BROKER; default: embedded, under HOME)
    broker_prefix       prefix for every broker key on Redis (TOOLLEDGER_BROKER_PREFIX, none)
    sandbox             sandbox root, one directory per scope (TOOLLEDGER_SANDBOX; HOME/sandbox)
    lease_seconds       a claim's lease, renewed every lease/3 (TOOLLEDGER_LEASE_SECONDS, 30)
    soft_time_limit     a tool's soft limit, seconds (TOOLLEDGER_SOFT_TIME_LIMIT, 2/3 lease)
    time_limit          a tool's hard limit, seconds (TOOLLEDGER_TIME_LIMIT, 5/6 lease)
    visibility_timeout  Redis redelivers unacked messages after this (TOOLLEDGER_VISIBILITY_TIMEOUT,
                        3600); must exceed lease + hard limit
    max_args_bytes      cap on a call's canonical arguments (TOOLLEDGER_MAX_ARGS_BYTES, 1 MiB)
    max_content_bytes   cap on file content a tool writes (TOOLLEDGER_MAX_CONTENT_BYTES, 512 KiB)
    sweep_interval      seconds between beat sweeps (TOOLLEDGER_SWEEP_INTERVAL, 10)
    sweep_grace         extra seconds past lease expiry before unknown (TOOLLEDGER_SWEEP_GRACE, 5)
    requeue_after       re-publish approved work unclaimed this long (TOOLLEDGER_REQUEUE_AFTER, 120)
    tool_wait           seconds a worker that does not load a call's tool leaves it approved for
                        one that does, from its authorisation (TOOLLEDGER_TOOL_WAIT, 900; 0:
                        it fails the call at once, "unknown tool")
    tools               module with user tools to import (TOOLLEDGER_TOOLS, none)
    queue               the queue tool jobs travel on (TOOLLEDGER_QUEUE, "toolledger")
    failpoints          crash windows to open, DESIGN §5 (TOOLLEDGER_FAILPOINTS, none)
    failpoint_log       where each firing is logged, JSON lines (TOOLLEDGER_FAILPOINT_LOG, none)
    db_timeout          seconds a worker's database statement, connect or lock wait may take
                        (TOOLLEDGER_DB_TIMEOUT, lease/4): a hung connection cannot stall a
                        lease renewal past the lease
    lock_wait           seconds a landing waits for a path's lock before leaving it to the next
                        settle (TOOLLEDGER_LOCK_WAIT, 2)
    effects_log         tests and chaos: one JSON line per effect landed (TOOLLEDGER_EFFECTS_LOG)
    max_auto_retries    automatic retries of one call at most, for tools whose contract allows
                        them (TOOLLEDGER_MAX_AUTO_RETRIES, 3; 0 turns them off)
    """

    home: Path
    db: str
    broker: str
    broker_prefix: str
    sandbox: Path
    lease_seconds: float
    soft_time_limit: float  # 0: derived from the lease
    time_limit: float  # 0: derived from the lease
    visibility_timeout: float
    max_args_bytes: int
    max_content_bytes: int
    sweep_interval: float
    sweep_grace: float
    requeue_after: float
    tool_wait: float
    tools: str
    queue: str
    failpoints: str
    failpoint_log: str
    db_timeout: float  # 0: derived from the lease
    lock_wait: float
    effects_log: str
    max_auto_retries: int

    def __init__(self, **given: Any) -> None:
        """The TOOLLEDGER_* variables of the process's environment, then ``given``."""
        values = {**_from_environ(os.environ), **given}
        self._fill(_checked(values, PREFIX))

    def _fill(self, values: dict[str, Any]) -> None:
        for name, value in values.items():
            object.__setattr__(self, name, value)
        self._derive()

    def _derive(self) -> None:
        """Defaults that follow from others, derived once (the object is frozen after)."""
        derived: dict[str, Any] = {}
        odd = _URL_BREAKERS.search(str(self.home)) if not self.db or not self.broker else None
        if odd is None and not self.broker:
            # kombu reads ";" in a broker URL as a list of failover URLs: home "a;1" made the
            # embedded broker the file "a" beside it, shared with home "a;2" (a cold review)
            odd = _BROKER_URL_BREAKERS.search(str(self.home))
        if odd is not None:
            # a URL reads "?" as a query and "%41" as an escape: "h%41" put the ledger in
            # "hA", "q?x=1" made the file "q" beside the home (a cold review); "#" and a "%"
            # not followed by two hex digits are read as written (refused at first: helper-103)
            raise ConfigError(
                f"TOOLLEDGER_HOME {str(self.home)!r} holds {odd.group()!r}, which a ledger URL "
                "cannot carry: use another directory, or give TOOLLEDGER_DB and "
                "TOOLLEDGER_BROKER"
            )
        if not self.db:
            derived["db"] = f"sqlite:///{self.home / 'ledger.db'}"
        if not self.broker:
            derived["broker"] = f"embedded+sqlite:///{self.home / 'broker.db'}"
        if self.sandbox == Path():
            derived["sandbox"] = self.home / "sandbox"
        if not self.soft_time_limit:
            derived["soft_time_limit"] = round(self.lease_seconds * 2 / 3, 3)
        if not self.time_limit:
            derived["time_limit"] = round(self.lease_seconds * 5 / 6, 3)
        if not self.db_timeout:
            derived["db_timeout"] = round(max(1.0, self.lease_seconds / 4), 3)
        for name, value in derived.items():
            object.__setattr__(self, name, value)
        self._check_layout()

    def _check_layout(self) -> None:
        """Refuse what no single value shows wrong: the ledger (its home, its SQLite files)
        inside the sandbox, where an agent's ``write_file`` reaches it (a cold review wrote
        "pwned" over ``ledger.db``); a ledger in memory, which forgets every call when the
        process ends; a queue name Celery would read as a list."""
        for name, folder in (("TOOLLEDGER_SANDBOX", self.sandbox), ("TOOLLEDGER_HOME", self.home)):
            if folder.exists() and not folder.is_dir():  # "Not a directory", exit 1, before
                raise ConfigError(f"{name}: {folder} is not a directory")
        sandbox = _real(self.sandbox)
        places = {"TOOLLEDGER_HOME": self.home}
        for name, url in (("TOOLLEDGER_DB", self.db), ("TOOLLEDGER_BROKER", self.broker)):
            if path := _sqlite_file(url):
                places[name] = Path(path)
        for name, place in places.items():
            real = _real(place)
            # home: none of its folders may be a scope's; a SQLite file: not in a scope's folder
            # (one at the sandbox's top is no scope's: a scope is a folder of that name)
            if name == "TOOLLEDGER_HOME":
                reachable = real == sandbox or sandbox in real.parents
            else:
                reachable = sandbox in real.parent.parents
            if reachable:
                where = "its SQLite file is" if name != "TOOLLEDGER_HOME" else f"{place} is"
                raise ConfigError(
                    f"{name}: {where} inside the sandbox ({self.sandbox}): the agents' tools "
                    "could write over the ledger; put the sandbox and the ledger apart"
                )
        _refuse_dangling("TOOLLEDGER_HOME", self.home)
        _refuse_dangling("TOOLLEDGER_SANDBOX", self.sandbox)
        for name, url in (("TOOLLEDGER_DB", self.db), ("TOOLLEDGER_BROKER", self.broker)):
            if (path := _sqlite_file(url)) is not None and not Path(path).is_dir():
                _refuse_dangling(name, Path(path).parent)  # a directory: refused below
        scheme, _, rest = self.db.partition("://")
        if scheme.startswith("sqlite") and (
            rest in ("", "/", "/:memory:") or "mode=memory" in rest or rest.startswith("/?")
        ):
            raise ConfigError(
                "TOOLLEDGER_DB: an in-memory SQLite ledger forgets every call when the process "
                "ends: give it a file (sqlite:///path/ledger.db)"
            )
        for name, url, file in (
            ("TOOLLEDGER_DB", self.db, "ledger.db"),
            ("TOOLLEDGER_BROKER", self.broker, "broker.db"),
        ):  # a folder given for the file: "unable to open database file", exit 1, unnamed
            if (path := _sqlite_file(url)) and Path(path).is_dir():
                raise ConfigError(
                    f"{name}: {path} is a directory: the URL names the SQLite file itself "
                    f"({url.partition(':///')[0]}:///{path.rstrip('/')}/{file}?)"
                )
        if not _QUEUE_NAME.fullmatch(self.queue):
            raise ConfigError(
                f"TOOLLEDGER_QUEUE={self.queue!r}: a queue name is 1-200 of [A-Za-z0-9._-] "
                "(a comma would make Celery's workers consume a list of queues the jobs never "
                "reach)"
            )

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"settings are frozen: use with_({name}=...)")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("settings are frozen")

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in FIELDS}

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.as_dict() == other.as_dict()

    def __hash__(self) -> int:
        return hash(tuple(self.as_dict().values()))

    def __repr__(self) -> str:  # never the URLs: they may hold a password
        shown = ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items() if k not in _SECRET)
        return f"{type(self).__name__}({shown})"

    @property
    def sweep_queue(self) -> str:
        return f"{self.queue}.sweep"

    @property
    def embedded_broker(self) -> bool:
        return self.broker.startswith(("embedded+", "sqla+"))

    def check(self) -> None:
        """Refuse inconsistent limits (DESIGN §7): soft < hard < lease < visibility timeout."""
        # named as the variables a user sets (a refusal said "visibility_timeout",
        # "soft_time_limit": no setting of the README's table)
        soft, hard, lease = self.soft_time_limit, self.time_limit, self.lease_seconds
        if not 0 < soft < hard < lease:
            raise ConfigError(
                f"need 0 < {PREFIX}SOFT_TIME_LIMIT ({_figure(soft)}) < {PREFIX}TIME_LIMIT "
                f"({_figure(hard)}) < {PREFIX}LEASE_SECONDS ({_figure(lease)}) (the time "
                "limits default to 2/3 and 5/6 of the lease)"
            )
        if self.visibility_timeout <= lease + hard:
            raise ConfigError(
                f"{PREFIX}VISIBILITY_TIMEOUT ({_figure(self.visibility_timeout)}) must exceed "
                f"{PREFIX}LEASE_SECONDS + {PREFIX}TIME_LIMIT ({_figure(lease + hard)}): "
                "Redis would redeliver a task that is still running"
            )
        if self.db_timeout * 2 > lease:
            raise ConfigError(
                f"{PREFIX}DB_TIMEOUT ({_figure(self.db_timeout)}) must be at most half of "
                f"{PREFIX}LEASE_SECONDS ({_figure(lease)}): a hung renewal must leave time "
                "for another"
            )

    def with_(self, **changes: Any) -> Settings:
        """A copy with ``changes`` (None: unchanged), validated like the original."""
        values = {**self.as_dict(), **{k: v for k, v in changes.items() if v is not None}}
        return self._made(_checked(values, ""))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """From the TOOLLEDGER_* variables of ``env`` (default: the process's environment),
        then ``overrides`` (None: not given). A bad value is a ConfigError naming it."""
        given = {k: v for k, v in overrides.items() if v is not None}
        environ = os.environ if env is None else env
        _warn_misspelt(environ)
        values = _from_environ(environ)
        return cls._made(_checked({**values, **given}, PREFIX))

    @classmethod
    def _made(cls, values: dict[str, Any]) -> Settings:
        made = object.__new__(cls)
        made._fill(values)
        return made


_QUEUE_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")


def _refuse_dangling(name: str, folder: Path) -> None:
    """ConfigError if ``folder`` or a folder above it is a symbolic link to nothing (its
    target missing, or a loop): making the folder failed with "File exists: PATH" or "Too many
    levels of symbolic links", exit 1, a failure named as if the link were a file."""
    for place in (folder, *folder.parents):
        if place.is_symlink() and not place.exists():
            target = os.readlink(place)
            raise ConfigError(
                f"{name}: {place} is a symbolic link to {target}, which does not exist "
                "(or is a loop)"
            )
        if place.exists():
            return  # every folder above an existing one exists


def shown_url(url: str) -> str:
    """``url`` as it may be shown (a log, a terminal): its password, if it has one, as ***."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
    except ValueError:
        return "(a URL that does not parse)"
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def _real(path: Path) -> Path:
    """``path`` absolute with every symlink of its existing part resolved (it may not exist)."""
    return Path(os.path.realpath(os.path.abspath(path)))


def _sqlite_file(url: str) -> str | None:
    """The file a SQLite URL names (``sqlite:///x.db``, ``embedded+sqlite:///x.db``), if any."""
    scheme, sep, rest = url.partition(":///")
    if not sep or "sqlite" not in scheme.lower().split("+"):
        return None
    path = rest.split("?", 1)[0]
    return path if path and path != ":memory:" and not path.startswith("file:") else None


#: The schemes a setting's URL may have, exactly (a prefix let ``sqlitex://`` and ``redisx://``
#: through to a connection's error, or to none: kombu took ``memory://`` and the call sat
#: approved for ever).
_DB_SCHEMES = ("postgresql", "postgres", "postgresql+psycopg", "sqlite", "sqlite+pysqlite")
_BROKER_SCHEMES = (
    "redis",
    "rediss",
    "redis+socket",
    "amqp",
    "amqps",
    "pyamqp",
    "embedded+sqlite",
    *(f"sqla+{scheme}" for scheme in _DB_SCHEMES),
)
#: Schemes kombu knows that cannot carry toolledger's jobs, and why.
_BROKER_REFUSED = {
    "memory": "memory:// keeps each process's jobs in that process: no worker (another process) "
    "would ever receive one",
    "filesystem": "kombu's filesystem transport needs folders no URL gives, and it lost messages "
    "under polling consumers (worker/broker.py): use embedded+sqlite:///PATH",
}
#: Settings whose value is never echoed in an error (a URL may carry a password).
_SECRET = {"db", "broker"}
#: Those may come from a file instead, the variable holding its path (``TOOLLEDGER_DB_FILE``):
#: Docker's, compose's and Kubernetes' secrets are files, and an environment variable is seen
#: by ``docker inspect``, ``/proc/PID/environ`` and every child process.
FROM_FILE = {name: f"{name.upper()}_FILE" for name in sorted(_SECRET)}


def _from_environ(env: Mapping[str, str]) -> dict[str, str]:
    """The settings ``env`` gives (an empty variable gives none); others are not read. Names
    match in any case, as pydantic-settings matched them (``toolledger_db`` is read, not
    silently passed over for the embedded default); the upper-case spelling wins a tie. The
    variables outside the settings are checked too (``check_process_variables``)."""
    check_process_variables(env)
    found: dict[str, str] = {}
    for variable, value in env.items():
        upper = variable.upper()
        if value and upper.startswith(PREFIX) and (upper not in found or variable == upper):
            found[upper] = value
    out = {name: found[PREFIX + name.upper()] for name in FIELDS if PREFIX + name.upper() in found}
    for name, rest in FROM_FILE.items():
        if (path := found.get(PREFIX + rest)) is not None:
            out[name] = _secret_file(name, PREFIX + rest, path, given=name in out)
    return out


def _secret_file(name: str, variable: str, path: str, *, given: bool) -> str:
    """The setting ``name`` read from the file ``path`` names (``variable``), its ends'
    whitespace stripped (an editor's last newline); never echoed."""
    if given:
        raise ConfigError(f"{PREFIX}{name.upper()} and {variable} are both set: set one")
    try:
        value = Path(path).read_text(encoding="utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigError(f"{variable}: {path} is not UTF-8 text") from None
    except OSError as exc:
        raise ConfigError(f"{variable}: cannot read {path}: {exc.strerror or exc}") from None
    if not value:
        raise ConfigError(f"{variable}: {path} is empty")
    return value


#: TOOLLEDGER_* variables that are not settings but are read elsewhere (the API, the logs, the
#: metrics, the harnesses and the tests): never taken for a misspelt setting.
OTHER_VARIABLES = frozenset(
    {
        "API_TOKENS",
        "API_TOKENS_FILE",
        "API_SESSION_KEY",
        "LOG_FORMAT",
        "METRICS",
        "METRICS_PORT",
        "METRICS_ADDR",
        "SERVE_PORT",
        "SERVE_INSECURE_LOCAL",
        "SERVE_SECURE_COOKIES",
        "DEBUG",
        "SCOPE",
        "FOLDER_WATCH",
        "SCREENSHOTS",
        "CHROMIUM",
        "BASELINE_DONE",
    }
)
_warned: set[str] = set()


def _tell_as_text(message: str) -> None:
    print(f"toolledger: warning: {message}", file=sys.stderr)


#: How a warning about the settings themselves is told: a plain line on stderr, or, under the
#: CLI's ``--json``, a JSON object (``tell_warnings_with``).
_tell: Callable[[str], None] = _tell_as_text


def tell_warnings_with(tell: Callable[[str], None]) -> None:
    """Tell warnings about the settings (a misspelt variable) with ``tell`` from now on."""
    global _tell
    _tell = tell


#: How an on/off variable (TOOLLEDGER_METRICS, TOOLLEDGER_FOLDER_WATCH) may be spelt, any case.
SWITCH_ON = frozenset({"on", "1", "true", "yes"})
SWITCH_OFF = frozenset({"off", "0", "false", "no"})


def switch(env: Mapping[str, str], name: str, default: bool = True) -> bool:
    """The on/off variable ``name`` (unset or empty: ``default``). Anything else reads as
    ``default`` here: ``check_process_variables`` refuses it at every command's start."""
    value = env.get(name, "").strip().lower()
    return value in SWITCH_ON if value in SWITCH_ON | SWITCH_OFF else default


def check_process_variables(env: Mapping[str, str]) -> None:
    """The TOOLLEDGER_* variables outside the settings that every process reads where it uses
    them (logs, metrics, the folder watch): a malformed one is a ConfigError naming it, as a
    setting's is, rather than read as a default (a metrics port of ``x`` was no endpoint and
    no word on a worker, a traceback on the beat)."""

    def given(name: str) -> str | None:
        value = env.get(PREFIX + name)
        return value.strip() if value is not None and value.strip() else None

    def refuse(name: str, expected: str) -> NoReturn:
        raise ConfigError(f"{PREFIX}{name}={env[PREFIX + name]!r}: expected {expected}")

    for name in ("METRICS", "FOLDER_WATCH"):
        value = given(name)
        if value is not None and value.lower() not in SWITCH_ON | SWITCH_OFF:
            refuse(name, "on or off")
    value = given("LOG_FORMAT")
    if value is not None and value.lower() not in ("text", "json"):
        refuse("LOG_FORMAT", "text or json")
    value = given("METRICS_PORT")
    if value is not None and not (value.isascii() and value.isdigit() and int(value) <= 65535):
        refuse("METRICS_PORT", "a port number, 0 to 65535 (0: any free port)")
    value = given("METRICS_ADDR")
    if value is not None and not _ip_address(value):
        refuse("METRICS_ADDR", "an IP address to listen on (127.0.0.1, ::1, 0.0.0.0)")


def _ip_address(text: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _warn_misspelt(env: Mapping[str, str]) -> None:
    """Say once, on stderr, that a TOOLLEDGER_* variable close to a setting's name is not
    one (``TOOLLEDGER_LEASE_SECOND`` was ignored without a word: the lease stayed 30 s).
    Only close names: other TOOLLEDGER_* variables have readers of their own. Close names
    under a misspelt prefix too (``TOOLEDGER_DB``, ``TOOL_LEDGER_DB``), and a TOOLLEDGER_*
    variable holding a ledger's or a broker's URL however it is named
    (``TOOLLEDGER_DATABASE_URL``): each was ignored in silence, and every process took the
    embedded ledger of its working directory instead (a review)."""
    unknown = []
    for variable in env:
        upper = variable.upper()
        rest = upper.removeprefix(PREFIX)
        if variable in _warned:
            continue
        if rest == upper:  # not our prefix: one that reads like it, misspelt, is asked about
            if "LEDGER" in upper:
                unknown.append(variable)
            continue
        if not (
            rest.lower() in FIELDS
            or rest in OTHER_VARIABLES
            or rest in FROM_FILE.values()
            or rest.startswith(("TEST_", "CHAOS_"))
        ):
            unknown.append(variable)
    if not unknown:
        return
    import difflib  # only then: every command reads the settings

    names = [PREFIX + name.upper() for name in FIELDS]
    for variable in unknown:
        # a URL of ours says what it is meant for better than the name does
        meant = _url_setting(env[variable]) if variable.upper().startswith(PREFIX) else None
        close = [meant] if meant else difflib.get_close_matches(variable.upper(), names, 1, 0.85)
        if close:
            _warned.add(variable)
            _tell(f"{variable} is not a setting (did you mean {close[0]}?): ignored")


def _url_setting(value: str) -> str | None:
    """The variable a value belongs in if it is a ledger's or a broker's URL (never echoed)."""
    scheme, sep, _rest = value.strip().partition("://")
    if not sep:
        return None
    if scheme.lower() in _DB_SCHEMES:
        return PREFIX + "DB"
    return PREFIX + "BROKER" if scheme.lower() in _BROKER_SCHEMES else None


def _checked(values: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """Every setting, from ``values`` or its default, each read and checked; an error is one
    line naming the first bad setting (as ``PREFIX + NAME`` when read from the environment),
    its value unless it is a secret, and how many more are bad."""
    errors: list[tuple[str, Any, str]] = []
    out: dict[str, Any] = {}
    for name in values:
        if name not in FIELDS:
            errors.append((name, values[name], "Extra inputs are not permitted"))
    for name, (read, default) in FIELDS.items():
        if name not in values:
            out[name] = default
            continue
        try:
            out[name] = read(values[name])
            if name in _SECRET:
                _check_url(name, out[name])
        except ValueError as exc:
            errors.append((name, values[name], str(exc)))
    if errors:
        name, value, msg = errors[0]
        shown = f"{prefix}{name.upper()}" if prefix and name in FIELDS else name
        given = "" if name in _SECRET else f"={value!r}"
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ConfigError(f"{shown}{given}: {msg}{more}")
    return out


def _check_url(name: str, value: str) -> None:
    """A URL that parses, with a known scheme and a numeric port, refused at start (exit
    2) rather than by the first connection. Never echoed: it may hold a password."""
    if not value:
        return
    schemes = _DB_SCHEMES if name == "db" else _BROKER_SCHEMES
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError as exc:  # its message may quote the URL, password and all (as a "port")
        what = (
            "its port is not a number from 0 to 65535"
            if "Port" in str(exc)
            else "it does not parse"
        )
        raise ValueError(f"not a URL: {what}") from None
    scheme = parts.scheme.lower()
    if name == "broker" and scheme in _BROKER_REFUSED:
        raise ValueError(_BROKER_REFUSED[scheme])
    if scheme not in schemes:
        raise ValueError(f"scheme {parts.scheme!r} is not one of {', '.join(schemes)}")
    if "\x00" in value:
        raise ValueError("holds a NUL character")
    if parts.netloc.count("@") > 1 and (name == "db" or scheme.startswith("sqla+")):
        # SQLAlchemy ends the password at its first "@", urllib (the check above) at the
        # last: "u:p@ss@host" connected to the host "ss@host", and every error and worker
        # log line then quoted the password's tail ("failed to resolve host 'ss@host'")
        raise ValueError("its user name or password holds an '@': write it percent-encoded, as %40")
    if name == "broker" and scheme in ("redis", "rediss") and ";" not in value:
        # redis://HOST:PORT/N: N a database number, as kombu reads it (one leading slash off,
        # then int()): a worker with /abc crashed at its first connection, exit 0, three
        # tracebacks (a review). A failover list (a;b) is kombu's to read.
        number = parts.path[1:]
        if number not in ("", "/") and not re.fullmatch(r"[0-9]+", number):
            raise ValueError(f"its database {number!r} is not a number (redis://HOST:PORT/N)")
    if name == "db" and "sqlite" in scheme.split("+"):
        # the driver's busy timeout, read by sqlite3.connect at the first connection
        for key, item in parse_qsl(parts.query, keep_blank_values=True):
            if key == "timeout" and not _seconds(item):
                raise ValueError(f"its timeout {item!r} is not a number of seconds")


def _seconds(text: str) -> bool:
    try:
        number = float(text)
    except ValueError:
        return False
    return math.isfinite(number) and number >= 0


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("Input should be a valid string")
    return value


def _url(value: Any) -> str:
    """A URL, stripped, a SQLite file's ``~`` expanded: ``sqlite:///~/x.db`` made a folder
    named ``~`` in the working directory (a cold review); a shell leaves a ``~`` in a URL."""
    # its ends' whitespace is no part of it: "…/ledger.db\n" (a YAML block scalar) was a
    # file of that name, another ledger than the workers' (a cold review)
    url = _text(value).strip()
    path = _sqlite_file(url)
    if path is None or not path.startswith("~"):
        return url
    scheme, _, rest = url.partition(":///")
    return f"{scheme}:///{os.path.expanduser(path)}{rest[len(path) :]}"


def _failpoints(value: Any) -> str:
    """A failpoint spec that parses (else it failed where the first call ran: exit 1)."""
    text = _text(value)
    if text:
        from toolledger.failpoints import parse

        parse(text)  # FailpointSpecError is a ValueError: named as the setting's
    return text


def _path(value: Any) -> Path:
    """A path, its leading ``~`` expanded: a shell leaves it as written in ``--sandbox=~/sb``,
    a compose or systemd environment file, and a folder named ``~`` was made (a cold review)."""
    if isinstance(value, Path):
        return value.expanduser()
    if not isinstance(value, str):
        raise ValueError("Input should be a valid path")
    return Path(value).expanduser()


def _number(value: Any) -> float:
    """A finite number (an infinite lease would derive every limit infinite), written in
    ASCII digits if a string."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError("Input should be a valid number")
    if isinstance(value, str) and not value.isascii():
        raise ValueError("Input should be a valid number, unable to parse string as a number")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(
            "Input should be a valid number, unable to parse string as a number"
        ) from None
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ValueError("Input should be a finite number")
    return number


def _integer(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.isascii():
        try:
            return int(value.strip())
        except ValueError:
            pass
        with contextlib.suppress(ValueError, OverflowError):  # "10.0", as pydantic took it
            number = float(value)
            if number.is_integer():
                return int(number)
    raise ValueError("Input should be a valid integer, unable to parse string as an integer")


def _bounded(read: Callable[[Any], Any], *, zero: bool) -> Callable[[Any], Any]:
    """``read``, then refused below zero (at zero too, unless ``zero``)."""

    def check(value: Any) -> Any:
        number = read(value)
        if number < 0 or (number == 0 and not zero):
            raise ValueError(f"Input should be greater than {'or equal to ' if zero else ''}0")
        return number

    return check


_positive, _non_negative = _bounded(_number, zero=False), _bounded(_number, zero=True)
#: A lease longer than a day is a mistake, not a setting: 1e12 s overflowed the database's
#: timestamps (a claim committed, its lease in year 33715, the call never run; a cold review).
MAX_LEASE_SECONDS = 86_400.0


_positive_int, _non_negative_int = _bounded(_integer, zero=False), _bounded(_integer, zero=True)

#: The longest any other time setting may be: past it a value is a mistake, and the sweep's
#: grace or requeue age at 1e12 s overflowed the database's timestamps, failing every pass on
#: Postgres: recovery off, said only as "timestamp out of range" (a cold review).
MAX_SETTING_SECONDS = 365 * 86_400.0


def _figure(bound: float) -> str:
    """A bound as a setting would take it: a whole number in full (``:g`` wrote 1 GiB as
    "1.07374e+09", which is not it), else as ``:g`` writes it (0.1)."""
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


def _at_most(read: Callable[[Any], Any], high: float, what: str) -> Callable[[Any], Any]:
    """``read`` (a number bounded below), then refused past ``high`` seconds."""

    def check(value: Any) -> Any:
        number = read(value)
        if number > high:
            raise ValueError(f"Input should be at most {_figure(high)} seconds ({what})")
        return number

    return check


_lease = _at_most(_positive, MAX_LEASE_SECONDS, "a day")


def _year_at_most(read: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return _at_most(read, MAX_SETTING_SECONDS, "a year")


def _within(read: Callable[[Any], Any], low: float, high: float, unit: str) -> Callable[[Any], Any]:
    """``read``, then refused outside [low, high]: past these a value is a mistake (1e30
    bytes of file content read as "no limit"; a sweep every millisecond)."""

    def check(value: Any) -> Any:
        number = read(value)
        if not low <= number <= high:
            raise ValueError(f"Input should be from {_figure(low)} to {_figure(high)} {unit}")
        return number

    return check


#: What a home's path may not hold to be written into a ledger's or broker's URL.
_URL_BREAKERS = re.compile(r"\?|%[0-9A-Fa-f]{2}")
#: What breaks a broker URL (kombu's list of failover URLs) but not a ledger's.
_BROKER_URL_BREAKERS = re.compile(r";")

#: Every setting: its name -> (how a given value is read and checked, its default). Read by
#: hand, not by pydantic-settings: importing that costs a CLI command more than its whole
#: query (0.2 s of the 0.25 s issue 18 allows ``toolledger show``).
FIELDS: dict[str, tuple[Callable[[Any], Any], Any]] = {
    "home": (_path, DEFAULT_HOME),
    "db": (_url, ""),
    "broker": (_url, ""),
    "broker_prefix": (_text, ""),
    "sandbox": (_path, Path()),
    "lease_seconds": (_lease, 30.0),
    "soft_time_limit": (_year_at_most(_non_negative), 0.0),
    "time_limit": (_year_at_most(_non_negative), 0.0),
    "visibility_timeout": (_year_at_most(_positive), 3600.0),
    # arguments live in a JSON column; file content is held in memory while it is staged
    "max_args_bytes": (_within(_integer, 1, 64 * 1024 * 1024, "bytes (64 MiB)"), MAX_ARGS_BYTES),
    "max_content_bytes": (_within(_integer, 1, 1024**3, "bytes (1 GiB)"), 512 * 1024),
    # as beat --interval: at least 0.1 s
    "sweep_interval": (_within(_number, 0.1, MAX_LEASE_SECONDS, "seconds"), 10.0),
    "sweep_grace": (_year_at_most(_non_negative), 5.0),
    # 0 re-publishes every approved, unclaimed call, as ``sweep --requeue-after 0`` does
    "requeue_after": (_year_at_most(_non_negative), 120.0),
    "tool_wait": (_year_at_most(_non_negative), 900.0),
    "tools": (_text, ""),
    "queue": (_text, "toolledger"),
    "failpoints": (_failpoints, ""),
    "failpoint_log": (_text, ""),
    # milliseconds in a 32-bit int, Postgres's statement timeout and SQLite's busy timeout
    "db_timeout": (_within(_number, 0, MAX_LEASE_SECONDS, "seconds (a day)"), 0.0),
    "lock_wait": (_year_at_most(_positive), 2.0),
    "effects_log": (_text, ""),
    "max_auto_retries": (_non_negative_int, 3),
}
