"""Alembic environment: run against the engine toolledger hands over (``db upgrade``).

Two processes may migrate at once (workers starting together on a fresh embedded ledger):
the migration takes the database's write lock first — BEGIN IMMEDIATE on SQLite, an advisory
lock on Postgres — so the second waits, then finds the schema already at head. Every
revision runs in that one transaction (SQLite's DDL is transactional, though Alembic does not
assume it): nobody ever sees the schema half-way between two revisions.
"""

from alembic import context

from toolledger.ledger.db import WRITE, create_engine
from toolledger.ledger.models import Base

MIGRATION_LOCK = 0x746C6D67  # "tlmg"

#: The shortest idle limit a migration's transaction is given (ms; see below).
IDLE_MIGRATION_MS = 60_000


def _milliseconds(setting: str) -> int:
    """A Postgres time setting as SHOW says it ("500ms", "7500ms", "1min", "0") in ms."""
    units = {"us": 0.001, "ms": 1, "s": 1000, "min": 60_000, "h": 3_600_000, "d": 86_400_000}
    number = setting.rstrip("abcdefghijklmnopqrstuvwxyz")
    return int(float(number) * units.get(setting[len(number) :], 1))


config = context.config
engine = config.attributes.get("engine") or create_engine(
    config.get_main_option("sqlalchemy.url") or "sqlite:///.toolledger/ledger.db"
)

with engine.connect() as connection:
    connection = connection.execution_options(**{WRITE: True})
    if connection.dialect.name == "postgresql":
        # Another migrator is waited for as long as it takes (the session's lock timeout,
        # the CLI's 7.5 s, made the second of two `db upgrade`s fail "database unavailable"
        # behind a long migration: a cold review); the DDL keeps the session's timeout, so
        # that an ALTER queued behind a long transaction cannot stall every worker behind it.
        timeout = connection.exec_driver_sql("SHOW lock_timeout").scalar_one()
        connection.exec_driver_sql("SET LOCAL lock_timeout = 0")
        connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})")
        connection.exec_driver_sql(f"SET LOCAL lock_timeout = '{timeout}'")
        # A migration works in Python between its statements (Alembic loads each script): a
        # short TOOLLEDGER_DB_TIMEOUT as the idle limit ended it mid-way on a loaded machine
        # ("terminating connection due to idle-in-transaction timeout": CI, 12-06, at 0.5 s).
        # At least a minute, so a frozen migrator still lets go of its locks.
        idle = connection.exec_driver_sql("SHOW idle_in_transaction_session_timeout")
        if (ms := _milliseconds(idle.scalar_one())) and ms < IDLE_MIGRATION_MS:
            connection.exec_driver_sql(
                f"SET LOCAL idle_in_transaction_session_timeout = {IDLE_MIGRATION_MS}"
            )
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        transactional_ddl=True,
        transaction_per_migration=False,
    )
    with context.begin_transaction():
        context.run_migrations()
    connection.commit()
