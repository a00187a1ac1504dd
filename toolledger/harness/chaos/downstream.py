"""The chaos run's downstream service: a payments API that honours idempotency keys.

``python -m toolledger.harness.chaos.downstream --port P --log FILE``. ``POST /charge`` with JSON
``{"key", "account", "cents", "execution_id"}`` charges once per key: a key seen before gets its
first receipt back and charges nothing (logged as a replay). ``GET /receipt?key=K`` answers
the receipt or 404 — how a reconciler asks. Every charge is appended to the log (fsync)
before the answer goes out, so the log holds every effect the service ever made, even those
whose caller never heard back. It reloads its receipts from the log when restarted.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from toolledger import jsonlines


class Payments:
    def __init__(self, log_path: str) -> None:
        self.log_path = log_path
        self.lock = threading.Lock()
        self.receipts: dict[str, dict[str, Any]] = {}
        for entry in jsonlines.read(log_path):
            if entry["kind"] == "charge":
                self.receipts[entry["key"]] = entry["receipt"]

    def _log(self, entry: dict[str, Any]) -> None:
        jsonlines.append(self.log_path, entry)

    def charge(self, body: dict[str, Any]) -> dict[str, Any]:
        key = str(body["key"])
        with self.lock:
            found = self.receipts.get(key)
            entry = {"key": key, "execution_id": body.get("execution_id"), "t": time.time()}
            if found is not None:
                self._log({"kind": "replay", **entry})
                return found
            receipt = {
                "charge_id": f"ch_{len(self.receipts) + 1}",
                "key": key,
                "account": body["account"],
                "cents": body["cents"],
            }
            self._log({"kind": "charge", **entry, "receipt": receipt})
            self.receipts[key] = receipt
            return receipt


def handler(payments: Payments) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            body = json.loads(self.rfile.read(length) or b"{}")
            if urlparse(self.path).path != "/charge" or "key" not in body:
                self._answer(404, {"error": "no such endpoint"})
                return
            self._answer(200, payments.charge(body))

        def do_GET(self) -> None:
            url = urlparse(self.path)
            key = parse_qs(url.query).get("key", [""])[0]
            found = payments.receipts.get(key) if url.path == "/receipt" else None
            self._answer(200, found) if found else self._answer(404, {"error": "no receipt"})

        def log_message(self, *_: Any) -> None:
            pass

    return Handler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--log", required=True)
    args = parser.parse_args(argv)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), handler(Payments(args.log)))
    print("downstream ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
