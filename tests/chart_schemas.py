"""The rendered objects checked against the schemas the API server would apply: Kubernetes'
own for the built-in kinds (kubernetes-validate, strict: an unknown field fails), and field
lists of our own for the custom resources the chart may render.

kubernetes-validate knows only built-in kinds. For the Prometheus Operator's
ServiceMonitor, PodMonitor and PrometheusRule (monitoring.coreos.com/v1), cert-manager's
Certificate (cert-manager.io/v1) and the Gateway API's HTTPRoute
(gateway.networking.k8s.io/v1) these are JSON schemas of our own, written from those
projects' CRDs for the subset of fields a chart like ours uses: an unknown field, a wrong
type or a missing required field fails, as the API server's structural schema would refuse
it (or, worse, silently prune it). A field the chart starts using is added here, from the CRD.
"""

from __future__ import annotations

from collections.abc import Mapping

import jsonschema
import kubernetes_validate

STRING = {"type": "string"}
BOOLEAN = {"type": "boolean"}
INTEGER = {"type": "integer"}
STRING_MAP = {"type": "object", "additionalProperties": STRING}
STRINGS = {"type": "array", "items": STRING}
# the Prometheus Operator's Duration ("30s", "1m30s"; no fractions)
DURATION = {
    "type": "string",
    "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?"
    "(([0-9]+)ms)?)$",
}
# a relabeling's actions, each also spelt capitalised (the operator takes both)
RELABEL_ACTIONS = [
    spelling
    for action in [
        "replace",
        "keep",
        "drop",
        "hashmod",
        "labelmap",
        "labeldrop",
        "labelkeep",
        "lowercase",
        "uppercase",
        "keepequal",
        "dropequal",
    ]
    for spelling in (action, action.capitalize())
]
KEY_USAGES = [
    "signing",
    "digital signature",
    "content commitment",
    "key encipherment",
    "key agreement",
    "data encipherment",
    "cert sign",
    "crl sign",
    "encipher only",
    "decipher only",
    "any",
    "server auth",
    "client auth",
    "code signing",
    "email protection",
    "s/mime",
    "ipsec end system",
    "ipsec tunnel",
    "ipsec user",
    "timestamping",
    "ocsp signing",
    "microsoft sgc",
    "netscape sgc",
]


def obj(required: tuple[str, ...] = (), **properties: Mapping) -> dict:
    """An object schema with exactly these properties (any other is refused)."""
    schema = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = list(required)
    return schema


def array(item: Mapping) -> dict:
    return {"type": "array", "items": item}


METADATA = obj(("name",), name=STRING, namespace=STRING, labels=STRING_MAP, annotations=STRING_MAP)
LABEL_SELECTOR = obj(
    matchLabels=STRING_MAP,
    matchExpressions=array(obj(("key", "operator"), key=STRING, operator=STRING, values=STRINGS)),
)
NAMESPACE_SELECTOR = obj(any=BOOLEAN, matchNames=STRINGS)
RELABELING = obj(
    sourceLabels=STRINGS,
    separator=STRING,
    targetLabel=STRING,
    regex=STRING,
    modulus=INTEGER,
    replacement=STRING,
    action={"enum": RELABEL_ACTIONS},
)
SECRET_KEY = obj(("key",), name=STRING, key=STRING, optional=BOOLEAN)
SAFE_TLS = obj(
    ca=obj(secret=SECRET_KEY, configMap=SECRET_KEY),
    cert=obj(secret=SECRET_KEY, configMap=SECRET_KEY),
    keySecret=SECRET_KEY,
    serverName=STRING,
    insecureSkipVerify=BOOLEAN,
)
_ENDPOINT_FIELDS = {
    "path": STRING,
    "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
    "params": {"type": "object", "additionalProperties": STRINGS},
    "interval": DURATION,
    "scrapeTimeout": DURATION,
    "honorLabels": BOOLEAN,
    "honorTimestamps": BOOLEAN,
    "relabelings": array(RELABELING),
    "metricRelabelings": array(RELABELING),
    "tlsConfig": SAFE_TLS,
    "followRedirects": BOOLEAN,
    "enableHttp2": BOOLEAN,
}
INT_OR_STRING = {"type": ["integer", "string"]}
SERVICE_MONITOR_SPEC = obj(
    ("selector",),
    selector=LABEL_SELECTOR,
    namespaceSelector=NAMESPACE_SELECTOR,
    endpoints=array(obj(port=STRING, targetPort=INT_OR_STRING, **_ENDPOINT_FIELDS)),
    jobLabel=STRING,
    targetLabels=STRINGS,
    podTargetLabels=STRINGS,
    sampleLimit=INTEGER,
)
POD_MONITOR_SPEC = obj(
    ("selector",),
    selector=LABEL_SELECTOR,
    namespaceSelector=NAMESPACE_SELECTOR,
    podMetricsEndpoints=array(obj(port=STRING, portNumber=INTEGER, **_ENDPOINT_FIELDS)),
    jobLabel=STRING,
    podTargetLabels=STRINGS,
    sampleLimit=INTEGER,
)
RULE = obj(
    ("expr",),
    alert=STRING,
    record=STRING,
    expr=INT_OR_STRING,
    labels=STRING_MAP,
    annotations=STRING_MAP,
    keep_firing_for=DURATION,
    **{"for": DURATION},  # a Python keyword
)
PROMETHEUS_RULE_SPEC = obj(
    groups=array(
        obj(
            ("name", "rules"),
            name=STRING,
            interval=DURATION,
            limit=INTEGER,
            partial_response_strategy=STRING,
            rules=array(RULE),
        )
    )
)
CERTIFICATE_SPEC = obj(
    ("secretName", "issuerRef"),
    secretName=STRING,
    issuerRef=obj(("name",), name=STRING, kind=STRING, group=STRING),
    commonName=STRING,
    subject=obj(
        organizations=STRINGS,
        countries=STRINGS,
        organizationalUnits=STRINGS,
        localities=STRINGS,
        provinces=STRINGS,
        streetAddresses=STRINGS,
        postalCodes=STRINGS,
        serialNumber=STRING,
    ),
    dnsNames=STRINGS,
    ipAddresses=STRINGS,
    uris=STRINGS,
    duration=STRING,
    renewBefore=STRING,
    usages=array({"enum": KEY_USAGES}),
    isCA=BOOLEAN,
    privateKey=obj(
        algorithm={"enum": ["RSA", "ECDSA", "Ed25519"]},
        encoding={"enum": ["PKCS1", "PKCS8"]},
        size=INTEGER,
        rotationPolicy={"enum": ["Never", "Always"]},
    ),
    secretTemplate=obj(labels=STRING_MAP, annotations=STRING_MAP),
)

PARENT_REF = obj(
    ("name",),
    group=STRING,
    kind=STRING,
    namespace=STRING,
    name=STRING,
    sectionName=STRING,
    port=INTEGER,
)
BACKEND_REF = obj(
    ("name",),
    group=STRING,
    kind=STRING,
    namespace=STRING,
    name=STRING,
    port=INTEGER,
    weight=INTEGER,
)
NAME_VALUE = obj(
    ("name", "value"), type={"enum": ["Exact", "RegularExpression"]}, name=STRING, value=STRING
)
HTTP_ROUTE_SPEC = obj(
    parentRefs=array(PARENT_REF),
    hostnames=STRINGS,
    rules=array(
        obj(
            name=STRING,
            matches=array(
                obj(
                    path=obj(
                        type={"enum": ["Exact", "PathPrefix", "RegularExpression"]}, value=STRING
                    ),
                    headers=array(NAME_VALUE),
                    queryParams=array(NAME_VALUE),
                    method=STRING,
                )
            ),
            backendRefs=array(BACKEND_REF),
            timeouts=obj(request=STRING, backendRequest=STRING),
        )
    ),
)

SPECS: dict[tuple[str, str], dict] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR_SPEC,
    ("monitoring.coreos.com/v1", "PodMonitor"): POD_MONITOR_SPEC,
    ("monitoring.coreos.com/v1", "PrometheusRule"): PROMETHEUS_RULE_SPEC,
    ("cert-manager.io/v1", "Certificate"): CERTIFICATE_SPEC,
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): HTTP_ROUTE_SPEC,
}


def is_custom(obj_: Mapping) -> bool:
    """Whether the object is one of the custom resources checked here."""
    return (obj_["apiVersion"], obj_["kind"]) in SPECS


def validate_custom(obj_: Mapping) -> None:
    """jsonschema.ValidationError when the resource uses a field its CRD does not have."""
    spec = SPECS[(obj_["apiVersion"], obj_["kind"])]
    schema = obj(
        ("apiVersion", "kind", "metadata", "spec"),
        apiVersion=STRING,
        kind=STRING,
        metadata=METADATA,
        spec=spec,
    )
    jsonschema.Draft202012Validator(schema).validate(obj_)


def problems(objects: list[dict], kube_version: str) -> list[str]:
    """What the API server of `kube_version` (with the CRDs above installed) would refuse,
    one line per field: `KIND/NAME: PATH: why`."""
    found = []
    for obj_ in objects:
        where = f"{obj_['kind']}/{obj_['metadata']['name']}"
        try:
            if is_custom(obj_):
                validate_custom(obj_)
            else:
                kubernetes_validate.validate(obj_, kube_version, strict=True)
        except jsonschema.ValidationError as exc:  # kubernetes-validate's errors are ones too
            path = ".".join(str(p) for p in exc.absolute_path)
            found.append(f"{where}: {path}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            found.append(f"{where}: {exc.message}")  # neither a built-in kind nor one above
    return found
