"""``/docs``: Swagger UI for the API, its scripts pinned to one release and checked by the
browser (Subresource Integrity).

FastAPI's own page loads ``swagger-ui-dist@5`` from a CDN, any 5.x release, unchecked: a bad
release or a CDN serving other bytes would run as the console's own origin, read a console
page with the person's session cookie, its CSRF token, and post approvals (a cold review of
the HTTP surface). Here the version is exact and each file's SHA-384 is given: the browser
runs nothing else. To move to another release, take its files' digests from the npm package
(``npm pack swagger-ui-dist@X``; ``openssl dgst -sha384 -binary FILE | openssl base64 -A``)."""

from __future__ import annotations

import html
import json

from fastapi.responses import HTMLResponse

SWAGGER_UI_VERSION = "5.36.0"
_CDN = f"https://cdn.jsdelivr.net/npm/swagger-ui-dist@{SWAGGER_UI_VERSION}"
#: The release's files and their SHA-384, from its npm package.
SCRIPT = (
    f"{_CDN}/swagger-ui-bundle.js",
    "sha384-fUpRgC19yPykTqzdrUbdAg8NTiu16NEKf9U12J+IJWCg8/1mEI8f2+PEIz60Wyd+",
)
STYLE = (
    f"{_CDN}/swagger-ui.css",
    "sha384-z/AtSaOHGn5MJ5auAHXUypohywlIWLBZo1jeGmhdpVIbCnFhxAH92cwdV41oyINc",
)


def swagger_page(openapi_url: str, title: str) -> HTMLResponse:
    """The page: the pinned style and script, then Swagger UI started on ``openapi_url``.
    No icon from a third party (FastAPI's fetched one from its own site)."""
    (js, js_sri), (css, css_sri) = SCRIPT, STYLE
    q = html.escape
    page = f"""<!DOCTYPE html>
<html>
<head>
<meta name="viewport" content="width=device-width, initial-scale=1.0">
<link type="text/css" rel="stylesheet" href="{q(css)}"
  integrity="{q(css_sri)}" crossorigin="anonymous">
<title>{q(title)}</title>
</head>
<body>
<div id="swagger-ui"></div>
<script src="{q(js)}"
  integrity="{q(js_sri)}" crossorigin="anonymous"></script>
<script>
SwaggerUIBundle({{
  url: {json.dumps(openapi_url)},
  dom_id: "#swagger-ui",
  layout: "BaseLayout",
  deepLinking: true,
  showExtensions: true,
  showCommonExtensions: true,
  presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
}})
</script>
</body>
</html>
"""
    return HTMLResponse(page, headers={"Referrer-Policy": "no-referrer"})
