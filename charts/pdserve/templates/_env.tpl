{{/*
The environment of a pdserve container: every setting a `PDSERVE_*` variable the program
reads (its config dataclasses make one of each field: services/pdserve/core/flags.py),
then the OTEL_* variables of tracing, then the role's extraEnv. A variable that extraEnv
names is left out here, so that extraEnv's value is the only one.

Called with (dict "root" $ "role" "decode" "spec" .Values.decode).
*/}}
{{- define "pdserve.env" -}}
{{- $root := .root }}
{{- $skip := list }}
{{- range .spec.extraEnv }}
{{- $skip = append $skip .name }}
{{- end }}
{{- $ctx := dict "root" $root "role" .role "spec" .spec "skip" $skip }}
{{- $idVariable := ternary "PDSERVE_ROUTER_ID" "PDSERVE_WORKER_ID" (eq .role "router") }}
{{- if not (has $idVariable $skip) }}
- name: {{ $idVariable }}
  valueFrom:
    fieldRef: {fieldPath: metadata.name}
{{- end }}
{{- include "pdserve.envPairs" (dict "skip" $skip "pairs" (list
  (list "PDSERVE_MODEL" $root.Values.model.path)
  (list "PDSERVE_HOST" "0.0.0.0")
  (list "PDSERVE_PORT" $root.Values.ports.grpc)
  (list "PDSERVE_INSECURE" (ternary nil "true" $root.Values.tls.enabled))
  (list "PDSERVE_GRACE" .spec.grace)
  (list "PDSERVE_LOG_FORMAT" $root.Values.logging.format)
  (list "PDSERVE_LOG_LEVEL" $root.Values.logging.level)
)) }}
{{- if not (has "PDSERVE_METRICS_PORT" $skip) }}
{{- /* empty: no endpoint (the image sets 9400) */}}
- name: PDSERVE_METRICS_PORT
  value: {{ ternary (toString $root.Values.ports.metrics) "" $root.Values.metrics.enabled | quote }}
{{- end }}
{{- include "pdserve.tlsEnv" $ctx }}
{{- if eq .role "router" }}
{{- include "pdserve.routerEnv" $ctx }}
{{- else }}
{{- include "pdserve.workerEnv" $ctx }}
{{- end }}
{{- include "pdserve.tracingEnv" (dict "root" $root "idVariable" $idVariable "component" .role "skip" $skip) }}
{{- with .spec.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The router's own settings. */}}
{{- define "pdserve.routerEnv" -}}
{{- $root := .root }}
{{- $spec := .spec }}
{{- include "pdserve.redisEnv" . }}
{{- include "pdserve.envPairs" (dict "skip" .skip "pairs" (list
  (list "PDSERVE_HTTP_PORT" (ternary $root.Values.ports.http nil $spec.http.enabled))
  (list "PDSERVE_SERVED_MODEL_NAME" $root.Values.model.servedModelName)
  (list "PDSERVE_DISCOVERY" $root.Values.discovery.mode)
  (list "PDSERVE_PREFILL_POLICY" $spec.prefillPolicy)
  (list "PDSERVE_PREFILL_PLACEMENT" $spec.prefillPlacement)
  (list "PDSERVE_COLOCATE_BELOW" $spec.colocateBelow)
  (list "PDSERVE_STREAM_INTERVAL" $spec.streamInterval)
  (list "PDSERVE_MAX_INFLIGHT" $spec.maxInflight)
  (list "PDSERVE_MAX_ATTEMPTS" $spec.maxAttempts)
  (list "PDSERVE_LEASE_TTL" $spec.leaseTtl)
  (list "PDSERVE_MAX_QUEUED_REQUESTS" $spec.maxQueuedRequests)
  (list "PDSERVE_QUEUE_TIMEOUT" $spec.queueTimeout)
  (list "PDSERVE_API_KEY_FILE" (ternary (printf "%s/%s" $root.Values.apiKeys.mountPath $root.Values.apiKeys.key) nil $root.Values.apiKeys.enabled))
)) }}
{{- if include "pdserve.kubernetesDiscovery" $root }}
{{- include "pdserve.envPairs" (dict "skip" .skip "pairs" (list
  (list "PDSERVE_K8S_NAMESPACE" $root.Release.Namespace)
  (list "PDSERVE_K8S_PREFILL_SERVICE" (include "pdserve.componentName" (dict "root" $root "component" "prefill")))
  (list "PDSERVE_K8S_DECODE_SERVICE" (include "pdserve.componentName" (dict "root" $root "component" "decode")))
)) }}
{{- end }}
{{- end }}

{{/* A worker's own settings: where others reach it, its engine (the pool's `engine`
over the chart's), and the registry it publishes to under Redis discovery. */}}
{{- define "pdserve.workerEnv" -}}
{{- if not (has "PDSERVE_ADVERTISE_HOST" .skip) }}
- name: PDSERVE_ADVERTISE_HOST
  valueFrom:
    fieldRef: {fieldPath: status.podIP}
{{- end }}
{{- $engine := deepCopy .root.Values.engine }}
{{- range $key, $value := .spec.engine }}
{{- $_ := set $engine $key $value }}
{{- end }}
{{- include "pdserve.envPairs" (dict "skip" .skip "pairs" (list
  (list "PDSERVE_DEVICE" $engine.device)
  (list "PDSERVE_DTYPE" $engine.dtype)
  (list "PDSERVE_BLOCK_SIZE" $engine.blockSize)
  (list "PDSERVE_MAX_MODEL_LEN" $engine.maxModelLen)
  (list "PDSERVE_KV_CACHE_BYTES" $engine.kvCacheBytes)
  (list "PDSERVE_NUM_KV_BLOCKS" $engine.numKvBlocks)
  (list "PDSERVE_MAX_NUM_SEQS" $engine.maxNumSeqs)
  (list "PDSERVE_MAX_NUM_BATCHED_TOKENS" $engine.maxNumBatchedTokens)
  (list "PDSERVE_ENABLE_PREFIX_CACHING" $engine.enablePrefixCaching)
  (list "PDSERVE_ENABLE_CHUNKED_PREFILL" $engine.enableChunkedPrefill)
  (list "PDSERVE_SEED" $engine.seed)
  (list "PDSERVE_THREADS" .spec.threads)
  (list "PDSERVE_ORPHAN_TIMEOUT" (ternary nil .spec.orphanTimeout (eq .role "prefill")))
  (list "PDSERVE_KV_PORT" (ternary .root.Values.ports.kv nil (eq (include "pdserve.kvPort" .) "true")))
)) }}
{{- if not (include "pdserve.kubernetesDiscovery" .root) }}
{{- include "pdserve.redisEnv" . }}
{{- end }}
{{- end }}

{{/* TLS: the role's certificate, key and CA as mounted from its Secret, and the
plaintext health-only port the probes ask. */}}
{{- define "pdserve.tlsEnv" -}}
{{- $tls := .root.Values.tls }}
{{- if $tls.enabled }}
{{- include "pdserve.envPairs" (dict "skip" .skip "pairs" (list
  (list "PDSERVE_TLS_CERT" (printf "%s/tls.crt" $tls.mountPath))
  (list "PDSERVE_TLS_KEY" (printf "%s/tls.key" $tls.mountPath))
  (list "PDSERVE_TLS_CA" (printf "%s/ca.crt" $tls.mountPath))
  (list "PDSERVE_TLS_SERVER_NAME" (include "pdserve.tlsServerName" .root))
  (list "PDSERVE_HEALTH_PORT" .root.Values.ports.health)
)) }}
{{- end }}
{{- end }}

{{/* PDSERVE_REDIS_URL: the bundled Redis' address with its password, expanded by the
kubelet from REDIS_PASSWORD (a Secret's key), or an external URL from its Secret. */}}
{{- define "pdserve.redisEnv" -}}
{{- if not (has "PDSERVE_REDIS_URL" .skip) }}
{{- if .root.Values.redis.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.redisSecretName" .root }}
      key: {{ .root.Values.redis.auth.passwordKey }}
- name: PDSERVE_REDIS_URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s:6379/0" (include "pdserve.redisHost" .root) | quote }}
{{- else }}
- name: PDSERVE_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .root.Values.externalRedis.existingSecret }}
      key: {{ .root.Values.externalRedis.urlKey }}
{{- end }}
{{- end }}
{{- end }}

{{/* The OTEL_* variables of the `tracing` block; each process names its service after
its role itself (pdserve-router, pdserve-decode, ...). */}}
{{- define "pdserve.tracingEnv" -}}
{{- $tracing := .root.Values.tracing }}
{{- if $tracing.enabled }}
{{- $attributes := list
  (printf "k8s.namespace.name=%s" .root.Release.Namespace)
  (printf "k8s.pod.name=$(%s)" .idVariable)
  (printf "k8s.deployment.name=%s" (include "pdserve.componentName" (dict "root" .root "component" .component))) }}
{{- range $key, $value := $tracing.resourceAttributes }}
{{- $attributes = append $attributes (printf "%s=%s" $key $value) }}
{{- end }}
{{- include "pdserve.envPairs" (dict "skip" .skip "pairs" (list
  (list "OTEL_EXPORTER_OTLP_ENDPOINT" $tracing.endpoint)
  (list "OTEL_EXPORTER_OTLP_PROTOCOL" $tracing.protocol)
  (list "OTEL_TRACES_SAMPLER" $tracing.sampler.name)
  (list "OTEL_TRACES_SAMPLER_ARG" $tracing.sampler.arg)
  (list "OTEL_RESOURCE_ATTRIBUTES" (join "," $attributes))
)) }}
{{- end }}
{{- end }}
