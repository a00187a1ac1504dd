# toolledger: one image for the migration, the workers, the beat and the server (serve).
# BASE is any Debian-like image with python3 (>= 3.11) and its venv module: the default is
# what users pull; the compose test builds on a local debootstrapped base (no registry there).
ARG BASE=python:3.11.10-slim-bookworm
FROM ${BASE}

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY ledger ./ledger
COPY worker ./worker
COPY recovery ./recovery
# the one import name: toolledger/ holds the API, the CLI, the harnesses and the links to the rooms
COPY toolledger ./toolledger
# A virtual environment of its own: the same on python:*-slim and on Debian's python3,
# whose system site-packages pip may not touch (PEP 668).
RUN python3 -m venv /opt/toolledger \
 && /opt/toolledger/bin/pip install '.[serve]' \
 && useradd --system --create-home --home-dir /home/toolledger toolledger \
 && mkdir -p /data/sandbox \
 && chown -R toolledger /data
ENV PATH=/opt/toolledger/bin:$PATH

# Celery refuses to be comfortable as root; so do we.
USER toolledger
ENV TOOLLEDGER_HOME=/data TOOLLEDGER_SANDBOX=/data/sandbox
ENTRYPOINT ["toolledger"]
CMD ["--help"]
