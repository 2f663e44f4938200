"""The OpenAI-compatible HTTP API of the router (`pdserve router --http-port N`).

`server.HttpServer` runs it on the router's event loop; `app` holds the routes,
`protocol` the request bodies, `convert` turns them into the router's requests
(`conversation` a Responses API request into a chat one first), `responses` the
router's answers into OpenAI's JSON (`response_objects` into the Responses API's),
`streams` and `asgi` run them, `errors` maps every failure to OpenAI's error shape and
status.

The server loads on first use: a router without `--http-port` does not import FastAPI
(a few hundred milliseconds of its start).
"""

from __future__ import annotations

import importlib

_SERVER = "pdserve.gateways.openai.server"
_LAZY = {"API_PATH": _SERVER, "HttpServer": _SERVER}
__all__ = ["API_PATH", "HttpServer"]  # noqa: F822 (they load in __getattr__)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
