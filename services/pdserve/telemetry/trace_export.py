"""Where spans go: a TracerProvider with a BatchSpanProcessor and an OTLP exporter, set up
from the standard OTEL_* variables alone (telemetry/tracing.py's `configure` installs it).

Tracing is on when OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is
set and OTEL_SDK_DISABLED is not `true`; OTEL_EXPORTER_OTLP_PROTOCOL picks the exporter
(`grpc`, the default, or `http/protobuf`). The SDK itself reads the rest:
OTEL_TRACES_SAMPLER(_ARG), OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME, OTEL_BSP_*,
OTEL_EXPORTER_OTLP_* (headers, timeouts, TLS), OTEL_PROPAGATORS. `service.name` defaults
to the process's role: `pdserve-router`, ... The exporters are the SDK's own
(opentelemetry-exporter-otlp-proto-grpc and -http).
"""

from __future__ import annotations

import os
from collections.abc import Callable

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def service_name(role: str) -> str:
    """A process's `service.name` when OTEL_SERVICE_NAME does not set one."""
    return f"pdserve-{role}"


def _grpc_exporter():
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def _http_exporter():
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


# OTEL_EXPORTER_OTLP_PROTOCOL's values and their exporters (each reads its own variables).
EXPORTERS: dict[str, Callable[[], object]] = {
    "grpc": _grpc_exporter,
    "http/protobuf": _http_exporter,
}


def tracing_requested() -> bool:
    """Whether the OTEL_* variables ask for traces (an endpoint, and the SDK not disabled)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return any(os.environ.get(name) for name in ENDPOINT_VARIABLES)


def provider_from_env(role: str):
    """A TracerProvider exporting over OTLP as the OTEL_* variables say; None when they
    do not ask for traces. Raises ValueError for a protocol pdserve does not speak."""
    if not tracing_requested():
        return None
    from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"
    )
    exporter = EXPORTERS.get(protocol.strip())
    if exporter is None:
        raise ValueError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: pdserve exports traces over "
            + " or ".join(sorted(EXPORTERS))
        )
    # Attributes given to Resource.create win over the variables': name the role only
    # where neither OTEL_SERVICE_NAME nor OTEL_RESOURCE_ATTRIBUTES names the service.
    named = OTELResourceDetector().detect().attributes.get(SERVICE_NAME)
    resource = Resource.create({} if named else {SERVICE_NAME: service_name(role)})
    provider = TracerProvider(resource=resource)  # the sampler from OTEL_TRACES_SAMPLER
    provider.add_span_processor(BatchSpanProcessor(exporter()))
    return provider
