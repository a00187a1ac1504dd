"""The end-to-end path alone, for a profiler: a producer submitting approved calls to two
workers x 2 (prefork, or ``--pool threads``; ``--pool production``: the production
configuration) over Postgres and Redis, in a database of its own.

    py-spy record --subprocesses -o docs/bench/e2e-flame.svg -- \\
        python -m toolledger.harness.bench.profile_e2e --jobs 1500
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from toolledger.harness import scratch
from toolledger.harness.bench.e2e import E2E


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432/postgres")
    p.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    p.add_argument("--jobs", type=int, default=1500)
    p.add_argument(
        "--pool",
        choices=("prefork", "threads", "production"),
        default="prefork",
        help="production: the README's production configuration (the bench's "
        "toolledger_production: threads at 8 on the job queue alone, a sweeper, a beat)",
    )
    a = p.parse_args(argv)
    name = scratch.new_name("tl_prof")
    scratch.create_database(a.pg, name, migrate=True)
    try:
        root = Path(tempfile.mkdtemp(prefix="toolledger-profile-"))
        started = time.monotonic()
        db = a.pg.rsplit("/", 1)[0] + "/" + name
        e2e = E2E(a.pg, a.redis, root, a.jobs, print)
        if a.pool == "production":
            result = e2e.toolledger(db, production=True)
        else:
            result = e2e.toolledger(db, a.pool)
        print(f"{a.jobs} calls in {time.monotonic() - started:.1f} s: {result}")
    finally:
        scratch.drop_database(a.pg, name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
