"""``toolledger serve``: the JSON API, the console and /metrics, in one ASGI process.

- ``auth``     tokens, roles and scopes, browser sessions, CSRF;
- ``state``    the operations, each checked against the token (``Desk``);
- ``api``      the JSON API (``/api``), the CLI's ``--json`` shapes;
- ``console``  server-rendered pages, forms only, no script;
- ``app``      the ASGI application; ``run`` starts it under uvicorn.
"""
