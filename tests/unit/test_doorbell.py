"""Doorbells: a ring reaches every waiter announced, whatever the directory's path length;
a dead waiter's link is removed by the next ring; a ring with nobody waiting is harmless."""

from __future__ import annotations

import os
from pathlib import Path

from toolledger.ledger import doorbell


def test_ring__reaches_every_waiter_with_its_payload(tmp_path: Path) -> None:
    bells = doorbell.bell_dir(tmp_path / "ledger.db")
    with doorbell.Doorbell(bells) as a, doorbell.Doorbell(bells) as b:
        assert doorbell.ring(bells, b'[["s", "k"]]') == 2
        assert a.wait(5) == [b'[["s", "k"]]'] and b.wait(5) == [b'[["s", "k"]]']
        assert a.wait(0) == []  # one ring, one datagram


def test_ring__works_from_a_directory_too_long_for_a_socket_path(tmp_path: Path) -> None:
    deep = tmp_path.joinpath(*["d" * 40] * 5)  # > 200 bytes: no AF_UNIX path could live here
    bells = doorbell.bell_dir(deep / "ledger.db")
    assert len(str(bells)) > 108
    with doorbell.Doorbell(bells) as bell:
        assert doorbell.ring(bells) == 1
        assert bell.wait(5) == [b""]


def test_ring__removes_the_link_of_a_waiter_that_died(tmp_path: Path) -> None:
    bells = doorbell.bell_dir(tmp_path / "ledger.db")
    bell = doorbell.Doorbell(bells)
    bell.sock.close()  # as if its process was killed: the socket file stays, nobody reads
    os.unlink(bell.socket_path)
    assert doorbell.ring(bells) == 0
    assert list(bells.iterdir()) == []


def test_ring__with_no_directory_or_nobody_waiting_is_nothing(tmp_path: Path) -> None:
    assert doorbell.ring(tmp_path / "absent.bells") == 0
    bells = doorbell.bell_dir(tmp_path / "ledger.db")
    with doorbell.Doorbell(bells):
        pass  # closed: its link is gone
    assert doorbell.ring(bells) == 0


def test_ring__a_full_queue_still_counts_and_never_blocks(tmp_path: Path) -> None:
    bells = doorbell.bell_dir(tmp_path / "ledger.db")
    with doorbell.Doorbell(bells) as bell:
        for _ in range(5000):  # far more than the socket's buffer holds
            doorbell.ring(bells, b"x" * 1000)
        assert len(bell.drain()) > 0


def test_ring__reaches_a_waiter_that_named_the_ledger_through_a_symlink(tmp_path: Path) -> None:
    """helper-90: a home whose ledger.db is a symlink listened beside the link, committers
    rang beside the file, and its waits fell back to polling."""
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "ledger.db").touch()
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "ledger.db").symlink_to(tmp_path / "real" / "ledger.db")
    waiter = doorbell.bell_dir(tmp_path / "home" / "ledger.db")
    with doorbell.Doorbell(waiter) as bell:
        assert doorbell.ring(doorbell.bell_dir(tmp_path / "real" / "ledger.db"), b"x") == 1
        assert bell.wait(5) == [b"x"]
