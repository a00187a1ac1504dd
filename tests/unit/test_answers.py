"""The client-side bound on a statement's answer (ledger.answers): a socket whose peer never
answers is shut down at the deadline, one that answered in time is never touched."""

from __future__ import annotations

import socket
import time

from toolledger.ledger.answers import AnswerWatch, answer_wait


def test_answer_watch__a_wait_past_its_deadline_is_cut_one_that_ended_is_not() -> None:
    watch = AnswerWatch()
    ours, silent = socket.socketpair()
    other, peer = socket.socketpair()
    try:
        # Given a wait that ends in time, and one whose peer never answers
        with watch.bounded(other.fileno(), 0.2) as quick:
            pass
        start = time.monotonic()
        with watch.bounded(ours.fileno(), 0.3) as slow:
            ours.settimeout(5)
            got = ours.recv(1)  # Then the silent one's read ends at the deadline, in EOF
        assert (got, slow.cut) == (b"", True)
        assert 0.25 < time.monotonic() - start < 2
        time.sleep(0.2)
        # and the one that ended is left as it was
        peer.sendall(b"x")
        assert (other.recv(1), quick.cut) == (b"x", False)
    finally:
        for s in (ours, silent, other, peer):
            s.close()


def test_answer_wait__past_the_servers_own_bound_none_without_one() -> None:
    assert (answer_wait(None), answer_wait(0.5), answer_wait(7.5)) == (None, 1.5, 15.0)
