# toolledger: one image for the migration, the workers and the beat.
FROM python:3.11.10-slim-bookworm

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY ledger ./ledger
COPY worker ./worker
COPY recovery ./recovery
# the one import name: toolledger/ holds the API, the CLI, the harnesses and the links to the rooms
COPY toolledger ./toolledger
RUN pip install . \
 && useradd --system --create-home --home-dir /home/toolledger toolledger \
 && mkdir -p /data/sandbox \
 && chown -R toolledger /data

# Celery refuses to be comfortable as root; so do we.
USER toolledger
ENV TOOLLEDGER_HOME=/data TOOLLEDGER_SANDBOX=/data/sandbox
ENTRYPOINT ["toolledger"]
CMD ["--help"]
