"""The offered load now, from a Prometheus server that scrapes the routers.

The routers own the token counters (telemetry/metrics.py: each request's prompt tokens and
the tokens sent to clients are counted once, by the router that served it), so the load is
their rate summed over every router: `sum(rate(pdserve:prompt_tokens_total[W]))` and the
same of `generation_tokens_total`, through Prometheus' HTTP API (`/api/v1/query`). A
Prometheus server rather than each router's /metrics: behind a Service a scrape reaches
one router of several, and Prometheus has already kept the history a rate needs.

What the routers served understates what was offered while the pools are behind, so the
planner also adds headroom (`--headroom`), and scales up again on the next look.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from pdserve.planner.plan import Load

PROMPT_TOKENS = "pdserve:prompt_tokens_total"
OUTPUT_TOKENS = "pdserve:generation_tokens_total"
ROUTER_ROLE = "router"
QUERY_PATH = "/api/v1/query"
DEFAULT_TIMEOUT_S = 10.0


class LiveLoadError(RuntimeError):
    """Prometheus could not be asked, or did not answer with a number."""


def rate_query(counter: str, window_s: float) -> str:
    """PromQL for `counter`'s per-second rate over `window_s`, summed over the routers."""
    return f'sum(rate({counter}{{role="{ROUTER_ROLE}"}}[{window_s:g}s]))'


@dataclass(frozen=True, slots=True)
class PrometheusLoad:
    """The routers' token rates, as one Prometheus server has them."""

    url: str  # e.g. http://prometheus.monitoring:9090
    window_s: float = 300.0
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if urllib.parse.urlsplit(self.url).scheme not in ("http", "https"):
            raise ValueError(f"prometheus url must be http(s)://HOST:PORT, got {self.url!r}")
        if self.window_s <= 0:
            raise ValueError(f"the load window must be > 0 s, got {self.window_s:g}")

    def load(self) -> Load:
        prompt = self.query(rate_query(PROMPT_TOKENS, self.window_s))
        output = self.query(rate_query(OUTPUT_TOKENS, self.window_s))
        return Load(prompt, output, None, f"{self.url}, last {self.window_s:g} s")

    def query(self, promql: str) -> float:
        """One instant query's scalar value; 0 when no router has reported the counter
        yet (an idle release)."""
        url = self.url.rstrip("/") + QUERY_PATH + "?" + urllib.parse.urlencode({"query": promql})
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as response:
                answer = json.loads(response.read())
        except (OSError, ValueError) as exc:  # URLError and HTTPError are OSErrors
            raise LiveLoadError(f"{self.url}: {promql}: {exc}") from exc
        if answer.get("status") != "success":
            raise LiveLoadError(f"{self.url}: {promql}: {answer.get('error', answer)}")
        result = answer["data"]["result"]
        if not result:
            return 0.0
        value = float(result[0]["value"][1])
        return 0.0 if value != value else value  # NaN (no samples in the window): idle
