"""The documented reconciler contract for tools that call a downstream service."""

from examples import downstream_tool as ex
from toolledger.ledger.transitions import Status
from toolledger.sandbox import Sandbox
from toolledger.tools import ToolContext


def ctx(tmp_path, key="charge_account:call_1", scope="s"):
    return ToolContext(scope, Sandbox(tmp_path), "e1", key, 1)


def test_downstream__reconcile_asks_for_the_receipt_never_charges(tmp_path, monkeypatch):
    service = ex.InMemoryPayments()
    monkeypatch.setattr(ex, "SERVICE", service)
    args = ex.ChargeArgs(account="acme", cents=500)
    assert ex.reconcile_charge(args, ctx(tmp_path)) is None  # never charged: no evidence
    assert service.receipts == {}  # ... and asking did not charge
    done = ex.charge_account(args, ctx(tmp_path))
    found = ex.reconcile_charge(args, ctx(tmp_path))
    assert found.status is Status.SUCCEEDED and found.result == done
    other = ex.ChargeArgs(account="acme", cents=999)
    assert ex.reconcile_charge(other, ctx(tmp_path)) is None  # other terms: not proven


def test_downstream__the_key_makes_a_duplicate_harmless(tmp_path, monkeypatch):
    service = ex.InMemoryPayments()
    monkeypatch.setattr(ex, "SERVICE", service)
    args = ex.ChargeArgs(account="acme", cents=500)
    ex.charge_account(args, ctx(tmp_path))
    ex.charge_account(args, ctx(tmp_path))
    assert len(service.receipts) == 1


def test_downstream__two_scopes_calls_of_one_id_are_two_charges(tmp_path, monkeypatch):
    """The idempotency key is unique within its scope only: two conversations' call_1 sent
    the same key, and the downstream gave the second the first one's charge."""
    service = ex.InMemoryPayments()
    monkeypatch.setattr(ex, "SERVICE", service)
    alice = ex.charge_account(ex.ChargeArgs(account="alice", cents=100), ctx(tmp_path, scope="a"))
    bob = ex.charge_account(ex.ChargeArgs(account="bob", cents=999), ctx(tmp_path, scope="b"))
    assert (alice["account"], bob["account"]) == ("alice", "bob")
    assert sorted(service.receipts) == ["a/charge_account:call_1", "b/charge_account:call_1"]
