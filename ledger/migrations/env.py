"""Alembic environment: run against the engine toolledger hands over (``db upgrade``)."""

from alembic import context

from ledger.db import create_engine
from ledger.models import Base

config = context.config
engine = config.attributes.get("engine") or create_engine(
    config.get_main_option("sqlalchemy.url") or "sqlite:///.toolledger/ledger.db"
)

with engine.connect() as connection:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()
    connection.commit()
