import os
import random
import subprocess
import sys
import time

import pytest

from toolledger import failpoints, jsonlines
from toolledger.failpoints import FailpointError, FailpointSpecError, parse


@pytest.fixture(autouse=True)
def _reset():
    yield
    failpoints.configure(None)


def test_failpoints__unset_costs_nothing():
    failpoints.configure(None)
    assert not failpoints.armed()
    failpoints.configure("")
    assert not failpoints.armed()
    failpoints.configure("after_claim=off")
    assert failpoints.armed()
    failpoints.configure(None)


def test_failpoints__parse_every_form():
    actions = parse(
        "after_effect=exit(23); after_claim=10%raise;before_effect=2*sleep(0.5);after_terminal=stop"
    )
    assert (actions["after_effect"].kind, actions["after_effect"].arg) == ("exit", 23)
    assert (actions["after_claim"].kind, actions["after_claim"].probability) == ("raise", 0.1)
    assert (actions["before_effect"].remaining, actions["before_effect"].arg) == (2, 0.5)
    assert actions["after_terminal"].kind == "stop"


@pytest.mark.parametrize(
    "spec",
    [
        "nowhere=raise",
        "after_claim=explode",
        "after_claim=exit",
        "after_claim",
        "after_claim=sleep()",
        "after_claim=raise->",
        "after_claim=raise->raise->raise->raise->raise",
        # values that parsed, then failed where the point fired, after the claim
        "after_claim=sleep(nan)",
        "after_claim=sleep(inf)",
        "after_claim=sleep(-1)",
        "after_claim=sleep(1e12)",
        "after_claim=sleep(x)",
        "after_claim=exit(999)",
        "after_claim=exit(1.5)",
        "after_claim=exit(-1)",
        "after_claim=exit(\u00b2)",  # a digit to str.isdigit, not to int()
        "after_claim=kill(9)",
        "after_claim=stop()",
        "after_claim=150%raise",
    ],
)
def test_failpoints__bad_spec_refused(spec):
    with pytest.raises(FailpointSpecError):
        parse(spec)


def test_failpoints__count_limits_firing():
    failpoints.configure("after_claim=2*raise")
    for _ in range(2):
        with pytest.raises(FailpointError):
            failpoints.hit("after_claim")
    failpoints.hit("after_claim")  # the third time: nothing
    failpoints.hit("before_effect")  # not configured: nothing


def test_failpoints__probability_fires_about_that_often():
    random.seed(7)
    failpoints.configure("after_claim=20%raise")
    fired = 0
    for _ in range(2000):
        try:
            failpoints.hit("after_claim")
        except FailpointError:
            fired += 1
    assert 300 < fired < 500


def test_failpoints__sleep_sleeps():
    failpoints.configure("before_effect=sleep(0.2)")
    began = time.monotonic()
    failpoints.hit("before_effect")
    assert time.monotonic() - began >= 0.2


def test_failpoints__exit_is_immediate_with_the_code():
    code = (
        "from toolledger import failpoints; failpoints.configure('after_effect=exit(23)');"
        "failpoints.hit('after_effect'); print('survived')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 23 and "survived" not in proc.stdout


def test_failpoints__each_firing_is_logged_with_what_it_hit(tmp_path):

    log = tmp_path / "fp.log"
    failpoints.configure("after_claim=1*raise", str(log))
    with pytest.raises(FailpointError):
        failpoints.hit("after_claim", "exec-1")
    failpoints.hit("after_claim", "exec-2")  # spent: neither fires nor logs
    (line,) = jsonlines.read(log)
    assert (line["point"], line["action"], line["ref"]) == ("after_claim", "raise", "exec-1")


def test_failpoints__kill_is_a_real_sigkill():
    code = (
        "from toolledger import failpoints; failpoints.configure('before_effect=kill');"
        "failpoints.hit('before_effect')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30)
    assert proc.returncode == -9


def test_failpoints__first_fires_the_first_hit_then_the_percentage():
    failpoints.configure("after_stage=first+0%raise")  # 0 %: only the first hit can fire
    with pytest.raises(FailpointError):
        failpoints.hit("after_stage")
    for _ in range(50):
        failpoints.hit("after_stage")
    assert parse("after_claim=first+2.5%kill")["after_claim"].probability == 0.025
    with pytest.raises(FailpointSpecError):
        parse("after_claim=2.5%first+kill")


def test_failpoints__first_is_once_across_processes_sharing_the_log(tmp_path):
    """Each new worker child configures afresh: only the fleet's first hit may fire for sure."""
    log = tmp_path / "fp.log"
    code = (
        "import sys; from toolledger import failpoints;"
        f"failpoints.configure('after_stage=first+0%exit(23)', {str(log)!r});"
        "failpoints.hit('after_stage', sys.argv[1]); print('survived')"
    )
    runs = [
        subprocess.run([sys.executable, "-c", code, f"p{i}"], capture_output=True, timeout=30)
        for i in range(3)
    ]
    assert [r.returncode for r in runs] == [23, 0, 0]
    assert [line["ref"] for line in jsonlines.read(log)] == ["p0"]
    marker = failpoints.first_markers(str(log))[failpoints.POINTS.index("after_stage")]
    assert (tmp_path / "fp.log.first-after_stage").exists() and marker.endswith("first-after_stage")


def test_failpoints__a_chain_fires_the_first_of_its_actions_that_fires(tmp_path):
    """``a->b``: the fleet's first hit stops where a chaos run wakes it later, the next is
    killed; each ``first+`` of a chain claims a marker of its own."""
    log = tmp_path / "fp.log"
    failpoints.configure("after_stage=first+0%sleep(0.01)->first+0%raise->1*exit(3)", str(log))
    failpoints.hit("after_stage", "a")  # the first action's first hit: sleeps
    with pytest.raises(FailpointError):
        failpoints.hit("after_stage", "b")  # the second's
    code = (
        "from toolledger import failpoints;"
        f"failpoints.configure('after_stage=first+0%sleep(0.01)->first+0%raise->1*exit(3)',"
        f" {str(log)!r}); failpoints.hit('after_stage', 'c')"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30)
    assert run.returncode == 3  # both firsts are the fleet's already: the third action
    assert [(e["ref"], e["action"]) for e in jsonlines.read(log)] == [
        ("a", "sleep"),
        ("b", "raise"),
        ("c", "exit"),
    ]
    assert {
        p.rsplit(".first-", 1)[1] for p in failpoints.first_markers(str(log)) if os.path.exists(p)
    } == {"after_stage", "after_stage-1"}
