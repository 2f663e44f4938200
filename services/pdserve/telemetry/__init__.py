"""What pdserve tells operators: traces (OpenTelemetry), metrics (Prometheus), log lines.

`summary.RequestSummary` is what one finished request was; the router's session builds it
once, and the trace, the metrics and the log line each take what they need from it.
"""
