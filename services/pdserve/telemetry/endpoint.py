"""The `GET /metrics` endpoint of a pdserve process, on threads of its own (the event
loop never waits for a scrape).

It answers in Prometheus' text format 0.0.4 whatever the scrape's Accept header asks:
prometheus_client's OpenMetrics writer escapes `pdserve:` to `pdserve_`, and the names
Prometheus stores must be the ones the dashboard and the alert rules query.
"""

from __future__ import annotations

import socket
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

METRICS_PATH = "/metrics"


class MetricsServer(ThreadingHTTPServer):
    """Serves `registry` at GET /metrics; `serve_forever` on a thread, `shutdown` to stop."""

    daemon_threads = True  # a scrape in flight does not hold the process at exit

    def __init__(self, registry: CollectorRegistry, host: str, port: int):
        self.registry = registry
        if ":" in host:  # an IPv6 address
            self.address_family = socket.AF_INET6
        super().__init__((host, port), _MetricsHandler)


class _MetricsHandler(BaseHTTPRequestHandler):
    server: MetricsServer

    def do_GET(self) -> None:
        if urlsplit(self.path).path != METRICS_PATH:
            self.send_error(HTTPStatus.NOT_FOUND, f"metrics are at {METRICS_PATH}")
            return
        # text format 0.0.4 whatever Accept asks: it keeps `pdserve:` as written
        body = generate_latest(self.server.registry)
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:
        """Nothing: a line per scrape would bury the process's own log."""
