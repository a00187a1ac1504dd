"""Network partitions between one worker and Postgres, for the chaos run and its tests.

``Partition`` gives one worker a network path of its own to the database: a network
namespace joined to the host by a veth pair, in which ``toolledger.harness.chaos.proxy``
forwards TCP to Postgres's Unix socket. The worker connects to the namespace's address;
``cut()`` takes the link down inside the namespace, so the worker's packets vanish (no RST, no
FIN: a real partition, which only TCP timeouts reveal), while the sweep and everyone else still
reach Postgres directly. ``heal()`` brings it back. Needs root and iproute2 (``ip netns``);
``unavailable()`` says why not, for a loud skip.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

PROXY_PORT = 15432


def unavailable() -> str | None:
    """Why partitions cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    return None


def _ip(*argv: str, netns: str | None = None) -> None:
    prefix = ["ip", "netns", "exec", netns] if netns else []
    subprocess.run([*prefix, "ip", *argv], check=True, capture_output=True, timeout=30)


@dataclass
class Partition:
    """One worker's own cuttable path to a Postgres reached through ``unix_socket``."""

    unix_socket: str
    index: int = field(default_factory=lambda: random.randrange(1, 250))
    proxy: subprocess.Popen[bytes] | None = None

    @property
    def netns(self) -> str:
        return f"tlpart{self.index}"

    @property
    def outer(self) -> str:
        return f"tlp{self.index}a"

    @property
    def inner(self) -> str:
        return f"tlp{self.index}b"

    @property
    def address(self) -> str:
        return f"10.231.{self.index}.2"

    def start(self) -> str:
        """Build the namespace and the proxy; the ``host:port`` the worker should use."""
        self.close()  # a leftover of a crashed run with the same index
        _ip("netns", "add", self.netns)
        _ip("link", "add", self.outer, "type", "veth", "peer", "name", self.inner)
        _ip("link", "set", self.inner, "netns", self.netns)
        _ip("addr", "add", f"10.231.{self.index}.1/30", "dev", self.outer)
        _ip("link", "set", self.outer, "up")
        _ip("addr", "add", f"{self.address}/30", "dev", self.inner, netns=self.netns)
        _ip("link", "set", self.inner, "up", netns=self.netns)
        _ip("link", "set", "lo", "up", netns=self.netns)
        listen = f"{self.address}:{PROXY_PORT}"
        argv = [sys.executable, "-m", "toolledger.harness.chaos.proxy", "--listen", listen]
        self.proxy = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, *argv, "--unix", self.unix_socket],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        assert self.proxy.stdout is not None
        if b"proxy ready" not in self.proxy.stdout.readline():
            raise RuntimeError(f"the proxy in {self.netns} did not start")
        return listen

    def cut(self) -> None:
        """Black-hole the worker's path: its packets vanish from now on."""
        _ip("link", "set", self.inner, "down", netns=self.netns)

    def heal(self) -> None:
        _ip("link", "set", self.inner, "up", netns=self.netns)
        time.sleep(0.1)

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.kill()
            self.proxy.wait(10)
            self.proxy = None
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", self.outer)
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("netns", "del", self.netns)
