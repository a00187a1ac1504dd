"""The execution side: the Celery app (``celery -A toolledger.worker.app``), the execute
pipeline (claim -> running -> effect -> terminal), leases, the submitter, the embedded broker."""
