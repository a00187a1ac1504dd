"""Who is asking: API tokens, their roles and scopes, browser sessions and CSRF tokens.

Tokens come from ``TOOLLEDGER_API_TOKENS`` (comma-separated ``name:role:secret`` or
``name:role:secret:scope1|scope2``) and/or the file named by ``TOOLLEDGER_API_TOKENS_FILE``
(the same entries, one per line or comma-separated; ``#`` starts a comment). The token's
*name* is the actor the ledger records; nothing in a request can change it.

A browser logs in with a token once and then holds a signed session cookie (HttpOnly,
SameSite=Strict) naming the token and a random session id; rotating or removing the token ends
its sessions, logging out ends that one (its id is recorded in the ledger's database, which
every server process reads: ``ledger.sessions``). Every form carries a CSRF token derived from
the session.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import logging
import math
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from toolledger.config import ConfigError
from toolledger.ledger.errors import LedgerError
from toolledger.ledger.identity import check_scope, check_text_id

log = logging.getLogger("toolledger.serve")


def loopback_name(name: str) -> bool:
    """``localhost`` or a loopback address written as one: what ``serve --insecure-local``
    may bind, and the Host its requests may name (any loopback address: ``--host 127.0.0.2``
    started, then refused every request sent to it, a cold review). A name that is no
    address is never one (DNS rebinding points a name at 127.0.0.1)."""
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class Role(StrEnum):
    VIEWER = "viewer"  # reads
    AGENT = "agent"  # submits and reads: never decides on its own calls
    APPROVER = "approver"  # reads, approves and rejects
    OPERATOR = "operator"  # everything: also submits, resolves and retries


class Action(StrEnum):
    READ = "read"
    SUBMIT = "submit"
    DECIDE = "decide"  # approve / reject (and submit approved at once)
    RESOLVE = "resolve"
    RETRY = "retry"


#: What each role may do; anything else is 403.
ALLOWED: Mapping[Role, frozenset[Action]] = {
    Role.VIEWER: frozenset({Action.READ}),
    Role.AGENT: frozenset({Action.READ, Action.SUBMIT}),
    Role.APPROVER: frozenset({Action.READ, Action.DECIDE}),
    Role.OPERATOR: frozenset(Action),
}

#: Shortest secret accepted: a token is a password nobody types, so it can be long.
MIN_SECRET = 16
#: Longest secret accepted (a bearer longer than any token's is wrong without a hash).
MAX_SECRET = 4096
SESSION_SECONDS = 8 * 3600
SESSION_COOKIE = "toolledger_session"
LOGIN_COOKIE = "toolledger_login"
#: A session id as ``session_for`` writes it (``secrets.token_urlsafe(16)``).
SESSION_ID = re.compile(r"[A-Za-z0-9_-]{22}")


class Forbidden(LedgerError):
    """This token's role may not do that."""


class Throttled(LedgerError):
    """Too many wrong secrets from one address: it may try again in ``retry_after`` s."""

    def __init__(self, retry_after: float) -> None:
        self.retry_after = max(1, math.ceil(retry_after))
        super().__init__(
            f"too many wrong tokens from this address: try again in {self.retry_after} s"
        )


#: Wrong secrets an address may send at once, and the seconds that give it one more: 10 at
#: once, 10 a minute after that. A person who mistypes waits seconds; a guesser gets 14,400
#: guesses a day an address (a process: ``serve --workers N`` multiplies it by N).
FAILURE_BURST = 10
FAILURE_REFILL_SECONDS = 6.0
#: Addresses a throttle remembers at most (a few hundred bytes each: some 3 MB in all).
FAILURE_ADDRESSES = 10_000


class FailureThrottle:
    """Wrong secrets per client address, as a bucket: ``burst`` of them at once, one more
    every ``refill_seconds``. An address whose bucket is empty is refused *before* its secret
    is compared (``Throttled``: 429), so its guesses stop, whatever they are; a right secret
    from an address that is not throttled costs nothing. A try is counted as it starts and
    given back if its secret was right, so concurrent tries from one address cannot pass the
    burst together (hashing a long secret lets other threads run). IPv6 addresses count by
    their /64 (one host holds all of one); whatever is no address counts as one. At most
    ``max_addresses`` are remembered: past them, those forgiven are forgotten (at most once
    a second), and new addresses share a bucket with their /16 (IPv6: /32) until there is
    room: an address still throttled is never forgotten (forgetting the oldest let a pool of
    addresses reset its own, and each insertion scanned the table under the lock: helper-99).
    A right secret from an address made to wait is refused too: accepted, it would tell a
    guesser its guess was right, at any rate. Sessions already made are not throttled."""

    #: The bucket of whatever is no IP address, and of new addresses when the table is full.
    UNNAMED = "(not an address)"
    OVERFLOW = "(addresses past the table's size)"

    def __init__(
        self,
        burst: int = FAILURE_BURST,
        refill_seconds: float = FAILURE_REFILL_SECONDS,
        max_addresses: int = FAILURE_ADDRESSES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.burst, self.refill, self.max_addresses = burst, refill_seconds, max_addresses
        self._clock = clock
        self._lock = threading.Lock()
        # address -> [failures owed at ``at``, at, warned since it was last forgiven]
        self._buckets: dict[str, list[Any]] = {}
        self._purged_at = -math.inf

    @classmethod
    def key(cls, address: str) -> str:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return cls.UNNAMED
        if isinstance(ip, ipaddress.IPv6Address):
            if ip.ipv4_mapped is not None:  # ::ffff:1.2.3.4 is 1.2.3.4
                return str(ip.ipv4_mapped)
            # (by its number: a scoped address's "%eth0" made the network unparsable and the
            # request raise: helper-103)
            return str(ipaddress.IPv6Network((int(ip) >> 64 << 64, 64)))
        return str(ip)

    def _owed(self, key: str, now: float) -> float:
        """The failures the address still carries at ``now`` (0 when it is forgiven)."""
        bucket = self._buckets.get(key)
        return 0.0 if bucket is None else max(0.0, bucket[0] - (now - bucket[1]) / self.refill)

    def _wait_for(self, owed: float) -> float:
        return max(0.0, (owed - self.burst + 1) * self.refill)

    def _bucket(self, key: str, now: float) -> tuple[str, list[Any]]:
        """The bucket of ``key`` (made if new: in the overflow's when the table is full)."""
        if key not in self._buckets and len(self._buckets) >= self.max_addresses:
            if now - self._purged_at >= 1.0:
                self._purged_at = now
                for k in [k for k in self._buckets if self._owed(k, now) == 0]:
                    del self._buckets[k]
            if len(self._buckets) >= self.max_addresses:
                key = self._overflow(key)
        bucket = self._buckets.setdefault(key, [0.0, now, False])
        owed = self._owed(key, now)
        if owed == 0:
            bucket[2] = False  # forgiven: its next wait is said again
        bucket[0], bucket[1] = owed, now
        return key, bucket

    def _overflow(self, key: str) -> str:
        """Where a new address counts while the table is full: with the others of its /16
        (IPv6: /32), so that one pool filling the table makes only its own neighbours wait
        (one bucket for all let it refuse every new client: helper-102); past twice the
        table's size, with everyone."""
        if len(self._buckets) >= 2 * self.max_addresses:
            return self.OVERFLOW
        try:
            network = ipaddress.ip_network(key, strict=False)
        except ValueError:
            return self.OVERFLOW
        return f"{self.OVERFLOW} {network.supernet(new_prefix=16 if network.version == 4 else 32)}"

    def wait(self, address: str) -> float:
        """Seconds before ``address`` may try a secret again; 0: now."""
        key, now = self.key(address), self._clock()
        with self._lock:
            if key not in self._buckets and len(self._buckets) >= self.max_addresses:
                key = self._overflow(key)
            return self._wait_for(self._owed(key, now))

    def check(self, address: str) -> None:
        waited = self.wait(address)
        if waited > 0:
            raise Throttled(waited)

    def take(self, address: str) -> str:
        """A try from ``address``, counted as wrong until ``refund``: ``Throttled`` if it may
        not try now. Its bucket's key, for ``refund`` or ``confirm``."""
        now = self._clock()
        with self._lock:
            key, bucket = self._bucket(self.key(address), now)
            waited = self._wait_for(bucket[0])
            if waited > 0:
                raise Throttled(waited)
            bucket[0] += 1
            return key

    def refund(self, key: str) -> None:
        """The try counted by ``take`` was a right secret: it costs nothing."""
        with self._lock:
            bucket = self._buckets.get(key)
            if bucket is not None:
                bucket[0] = max(0.0, bucket[0] - 1)

    def confirm(self, key: str) -> None:
        """The try counted by ``take`` was wrong: said once, when the address starts to wait
        (once again only after it was forgiven in full)."""
        now = self._clock()
        with self._lock:
            bucket = self._buckets.get(key)
            if bucket is None or bucket[2]:
                return
            waited = self._wait_for(self._owed(key, now))
            if waited <= 0:
                return
            bucket[2] = True
        log.warning(
            "%d wrong tokens from %s: its secrets are refused for %.0f s, then one more every "
            "%.0f s",
            self.burst,
            key,
            math.ceil(waited),
            self.refill,
        )

    def failed(self, address: str) -> None:
        """One wrong secret from ``address``, whether or not it may try now."""
        now = self._clock()
        with self._lock:
            key, bucket = self._bucket(self.key(address), now)
            bucket[0] += 1
        self.confirm(key)


@dataclass(frozen=True)
class Token:
    name: str
    role: Role
    secret: str
    scopes: frozenset[str] | None = None  # None: every scope

    def may(self, action: Action) -> bool:
        return action in ALLOWED[self.role]

    def require(self, action: Action) -> None:
        if not self.may(action):
            raise Forbidden(f"token {self.name!r} ({self.role}) may not {action}")

    def sees(self, scope: str) -> bool:
        return self.scopes is None or scope in self.scopes


#: The one identity of ``serve --insecure-local`` (loopback only, no tokens configured).
LOCAL = Token("local", Role.OPERATOR, secrets.token_urlsafe(32))


_COMMENT = re.compile(r"(^|\s)#.*$")


def parse_tokens(text: str, source: str) -> list[Token]:
    """Entries ``name:role:secret[:scope|scope]`` separated by commas or newlines."""
    tokens: list[Token] = []
    # a comment starts at a "#" that begins the line or follows a space: one inside a secret
    # is the secret's (it was cut there, and the token refused, without a word)
    lines = [_COMMENT.sub("", line) for line in text.splitlines()]
    entries = [e.strip() for line in lines for e in line.split(",") if e.strip()]
    for n, entry in enumerate(entries, 1):
        where = f"{source}, entry {n}"
        parts = entry.split(":")
        if len(parts) not in (3, 4):
            raise ConfigError(f"{where}: expected name:role:secret[:scope1|scope2]")
        name, role, secret = (p.strip() for p in parts[:3])
        try:
            check_text_id(name, "token name", 256)
            scopes = (
                frozenset(check_scope(s.strip()) for s in parts[3].split("|") if s.strip())
                if len(parts) == 4
                else None
            )
        except LedgerError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        # neither message quotes a field: in an entry written out of order, any may be the
        # secret (a cold review: "ana:SECRET:operator" printed the secret at start)
        if role not in Role.__members__.values():
            raise ConfigError(f"{where}: the second field is not a role ({', '.join(Role)})")
        if len(secret) < MIN_SECRET:
            raise ConfigError(f"{where}: the third field, the secret, is shorter than {MIN_SECRET}")
        if len(secret) > MAX_SECRET:
            raise ConfigError(f"{where}: the third field, the secret, is longer than {MAX_SECRET}")
        if scopes is not None and not scopes:
            raise ConfigError(f"{where}: empty scope list for {name!r}")
        tokens.append(Token(name, Role(role), secret, scopes))
    names = [t.name for t in tokens]
    if len(set(names)) != len(names):
        raise ConfigError(f"{source}: two tokens share a name")
    if len({t.secret for t in tokens}) != len(tokens):
        raise ConfigError(f"{source}: two tokens share a secret")
    return tokens


def load_tokens(env: Mapping[str, str] | None = None) -> list[Token]:
    """The tokens configured in the environment (both variables may be set)."""
    env = os.environ if env is None else env
    text, sources = "", []
    if env.get("TOOLLEDGER_API_TOKENS"):
        text += env["TOOLLEDGER_API_TOKENS"] + "\n"
        sources.append("TOOLLEDGER_API_TOKENS")
    if env.get("TOOLLEDGER_API_TOKENS_FILE"):
        path = Path(env["TOOLLEDGER_API_TOKENS_FILE"])
        try:
            text += path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"TOOLLEDGER_API_TOKENS_FILE: cannot read {path}: {exc}") from None
        sources.append(str(path))
    return parse_tokens(text, " + ".join(sources) or "tokens")


def same_text(known: str, given: str) -> bool:
    """Constant-time equality of two strings of any characters (``hmac.compare_digest``
    raises on a str that is not ASCII: a forged cookie or form field is not an error)."""
    return hmac.compare_digest(
        known.encode("utf-8", "surrogatepass"), given.encode("utf-8", "surrogatepass")
    )


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True)
class Session:
    """What a valid session cookie says: whose it is, its id and when it expires (epoch s)."""

    token: Token
    id: str
    expires: int


class Authenticator:
    """Finds the token behind a request: a bearer secret, or a session cookie."""

    def __init__(
        self,
        tokens: list[Token],
        session_key: bytes | None = None,
        throttle: FailureThrottle | None = None,
    ) -> None:
        self.tokens = tokens
        self.throttle = throttle or FailureThrottle()
        self._by_name = {t.name: t for t in tokens}
        # Sessions last as long as the key: a restart logs everyone out unless it is given.
        self._key = session_key or secrets.token_bytes(32)
        self._digests = [(hashlib.sha256(t.secret.encode()).digest(), t) for t in tokens]

    def by_secret_from(self, secret: str, address: str) -> Token | None:
        """``by_secret``, throttled by the client's address (``Throttled`` before any
        comparison when it sent too many wrong ones)."""
        key = self.throttle.take(address)
        token = self.by_secret(secret)
        if token is None:
            self.throttle.confirm(key)
        else:
            self.throttle.refund(key)
        return token

    def by_secret(self, secret: str) -> Token | None:
        """Constant-time in the secret: every token is compared, equal-length digests."""
        if len(secret) > MAX_SECRET:  # no token's: not worth hashing (4 MB headers were)
            return None
        digest = hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()
        found = None
        for known, token in self._digests:
            if hmac.compare_digest(known, digest):
                found = token
        return found

    def _sign(self, payload: str) -> str:
        data = payload.encode("utf-8", "surrogatepass")
        return _b64(hmac.new(self._key, data, hashlib.sha256).digest())

    def _fingerprint(self, token: Token) -> str:
        """Changes when the secret does: a rotated token's sessions end. Keyed with the
        session key: the cookie (readable by whoever holds it) is no oracle for the secret."""
        return self._sign(f"fingerprint\0{token.name}\0{token.secret}")[:32]

    def session_for(self, token: Token, now: float | None = None) -> str:
        body = json.dumps(
            {
                "n": token.name,
                "f": self._fingerprint(token),
                "s": secrets.token_urlsafe(16),
                "e": int((now or time.time()) + SESSION_SECONDS),
            },
            separators=(",", ":"),
        )
        payload = _b64(body.encode())
        return f"{payload}.{self._sign(payload)}"

    def by_session(self, cookie: str | None, now: float | None = None) -> Token | None:
        session = self.session_of(cookie, now)
        return None if session is None else session.token

    def session_of(self, cookie: str | None, now: float | None = None) -> Session | None:
        """The session a cookie holds, if its signature, token and expiry are good. Whether it
        was ended by a logout is the ledger's to say (``Desk.session_live``)."""
        if not cookie or cookie.count(".") != 1:
            return None
        payload, mac = cookie.split(".")
        if not same_text(self._sign(payload), mac):
            return None
        try:
            body = json.loads(_unb64(payload))
            name, fingerprint, sid, expires = body["n"], body["f"], body["s"], body["e"]
        except (ValueError, KeyError, TypeError):
            return None  # a cookie from before session ids (0005): log in again
        token = self._by_name.get(name) if isinstance(name, str) else None
        if token is None or not (
            isinstance(fingerprint, str) and same_text(self._fingerprint(token), fingerprint)
        ):
            return None  # removed or rotated since
        if not isinstance(expires, int) or expires < (now or time.time()):
            return None
        if not isinstance(sid, str) or not SESSION_ID.fullmatch(sid):
            return None
        return Session(token, sid, expires)

    def csrf_for(self, session: str) -> str:
        """The CSRF token of a session: forms carry it, a forged cross-site post cannot."""
        return self._sign(f"csrf\0{session}")

    def check_csrf(self, session: str, given: str | None) -> bool:
        return bool(given) and same_text(self.csrf_for(session), given or "")
