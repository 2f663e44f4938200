{{/*
Names, labels and the small facts every template shares.
*/}}

{{/* The chart's name (nameOverride wins). */}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The prefix of every object's name: the release's name, with the chart's name when
the release's does not hold it. Short enough for a role suffix ("-prefill") to fit 63. */}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 48 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* name-version, as the helm.sh/chart label carries it. */}}
{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object; a component's objects add app.kubernetes.io/component. */}}
{{- define "pdserve.labels" -}}
helm.sh/chart: {{ include "pdserve.chart" . }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* A component's labels: (dict "root" $ "component" "decode"). */}}
{{- define "pdserve.componentLabels" -}}
{{ include "pdserve.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "pdserve.componentSelectorLabels" -}}
{{ include "pdserve.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* A component's object name: (dict "root" $ "component" "decode") -> <fullname>-decode. */}}
{{- define "pdserve.componentName" -}}
{{- printf "%s-%s" (include "pdserve.fullname" .root) .component }}
{{- end }}

{{/* The worker pools this release runs, in a fixed order: prefill, decode, both. */}}
{{- define "pdserve.pools" -}}
{{- $pools := list }}
{{- range $pool := list "prefill" "decode" "both" }}
{{- if (index $.Values $pool).enabled }}
{{- $pools = append $pools $pool }}
{{- end }}
{{- end }}
{{- toJson $pools }}
{{- end }}

{{/* Every pdserve role this release runs: the router, then its pools. */}}
{{- define "pdserve.roles" -}}
{{- toJson (prepend (include "pdserve.pools" . | fromJsonArray) "router") }}
{{- end }}

{{/* A role's image: (dict "root" $ "spec" .Values.decode). The role's repository, tag
and flavour win over `image`'s; without a tag, <appVersion>-<flavour> (`make docker`'s). */}}
{{- define "pdserve.image" -}}
{{- $image := .root.Values.image }}
{{- $repository := .spec.image.repository | default $image.repository }}
{{- $flavour := .spec.image.flavour | default $image.flavour }}
{{- $tag := .spec.image.tag | default $image.tag | default (printf "%s-%s" .root.Chart.AppVersion $flavour) }}
{{- printf "%s:%s" $repository $tag }}
{{- end }}

{{/* The router's ServiceAccount name. */}}
{{- define "pdserve.routerServiceAccount" -}}
{{- if .Values.serviceAccount.create }}
{{- .Values.serviceAccount.routerName | default (printf "%s-router" (include "pdserve.fullname" .)) }}
{{- else }}
{{- .Values.serviceAccount.routerName | default "default" }}
{{- end }}
{{- end }}

{{/* The workers' ServiceAccount name. */}}
{{- define "pdserve.workerServiceAccount" -}}
{{- if .Values.serviceAccount.create }}
{{- .Values.serviceAccount.workerName | default (printf "%s-worker" (include "pdserve.fullname" .)) }}
{{- else }}
{{- .Values.serviceAccount.workerName | default "default" }}
{{- end }}
{{- end }}

{{/* Whether the router discovers its workers from EndpointSlices ("true" or ""). */}}
{{- define "pdserve.kubernetesDiscovery" -}}
{{- if eq .Values.discovery.mode "kubernetes" }}true{{ end }}
{{- end }}

{{/* The bundled Redis' Secret holding its password (the chart's or an existing one). */}}
{{- define "pdserve.redisSecretName" -}}
{{- .Values.redis.auth.existingSecret | default (printf "%s-redis" (include "pdserve.fullname" .)) }}
{{- end }}

{{/* The bundled Redis' client Service. */}}
{{- define "pdserve.redisHost" -}}
{{- printf "%s-redis.%s.svc" (include "pdserve.fullname" .) .Release.Namespace }}
{{- end }}

{{/* A scalar as an environment variable's text: YAML numbers reach templates as floats,
so whole ones are written as integers (21474836480, not 2.147483648e+10). */}}
{{- define "pdserve.scalar" -}}
{{- if and (kindIs "float64" .) (eq (float64 (int64 .)) .) }}
{{- int64 . }}
{{- else }}
{{- . }}
{{- end }}
{{- end }}

{{/* Environment entries from (dict "pairs" (list (list NAME VALUE) ...) "skip" NAMES):
a pair whose value is null or "" is left out (the program's default holds), and so is
one whose name `skip` holds (the role's extraEnv sets it instead). */}}
{{- define "pdserve.envPairs" -}}
{{- $skip := .skip }}
{{- range .pairs }}
{{- $name := index . 0 }}
{{- $value := index . 1 }}
{{- if and (not (kindIs "invalid" $value)) (ne (toString $value) "") (not (has $name $skip)) }}
- name: {{ $name }}
  value: {{ include "pdserve.scalar" $value | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* The termination grace period of a role: its preStop sleep, its drain, and ten
seconds to close (spans flushed, the model's memory freed). */}}
{{- define "pdserve.terminationGracePeriod" -}}
{{- add (int .preStopSleepSeconds) (int (ceil .grace)) 10 }}
{{- end }}

{{/* The fewest pods a role runs: (dict "root" $ "role" "decode" "spec" .Values.decode):
the planner's minReplicas for a pool it scales, else its autoscaler's, else its replicas. */}}
{{- define "pdserve.minReplicas" -}}
{{- if include "pdserve.plannerScales" . }}{{ (index .root.Values.planner .role).minReplicas }}
{{- else if .spec.autoscaling.enabled }}{{ .spec.autoscaling.minReplicas }}
{{- else }}{{ .spec.replicas }}{{ end }}
{{- end }}

{{/* Whether the planner scales this role's Deployment ("true" or ""): the prefill and
decode pools, when planner.enabled. (dict "root" $ "role" "decode") */}}
{{- define "pdserve.plannerScales" -}}
{{- if and .root.Values.planner.enabled (has .role (list "prefill" "decode")) }}true{{ end }}
{{- end }}

{{/* The planner's ServiceAccount name. */}}
{{- define "pdserve.plannerServiceAccount" -}}
{{- if .Values.serviceAccount.create }}
{{- .Values.serviceAccount.plannerName | default (printf "%s-planner" (include "pdserve.fullname" .)) }}
{{- else }}
{{- .Values.serviceAccount.plannerName | default "default" }}
{{- end }}
{{- end }}

{{/* The Secret holding a role's TLS certificate, key and CA: (dict "root" $ "role" "decode").
cert-manager's Certificate writes <fullname>-<role>-tls; with source `secrets`, yours. */}}
{{- define "pdserve.tlsSecretName" -}}
{{- $tls := .root.Values.tls }}
{{- if eq $tls.source "secrets" }}
{{- $name := index $tls.secrets .role }}
{{- if not $name }}
{{- fail (printf "tls.secrets.%s: the %s pods need a TLS Secret (tls.source is secrets)" .role .role) }}
{{- end }}
{{- $name }}
{{- else }}
{{- printf "%s-tls" (include "pdserve.componentName" (dict "root" .root "component" .role)) }}
{{- end }}
{{- end }}

{{/* The name checked in every worker's certificate in place of the pod IP dialled. */}}
{{- define "pdserve.tlsServerName" -}}
{{- .Values.tls.serverName | default (printf "%s.%s.svc" (include "pdserve.fullname" .) .Release.Namespace) }}
{{- end }}

{{/* Whether a role takes KV pushes on a port of its own ("true" or ""): decode and both
workers, when ports.kv is set. (dict "root" $ "role" "decode") */}}
{{- define "pdserve.kvPort" -}}
{{- if and (has .role (list "decode" "both")) (not (kindIs "invalid" .root.Values.ports.kv)) }}true{{ end }}
{{- end }}

{{/* The port the probes and `helm test` ask grpc.health.v1 on: the plaintext health port
under TLS, else the gRPC port. */}}
{{- define "pdserve.healthPort" -}}
{{- if .Values.tls.enabled }}{{ .Values.ports.health }}{{ else }}{{ .Values.ports.grpc }}{{ end }}
{{- end }}

{{/* An IntOrString count ("25%" or 2) of `replicas` pods, as Kubernetes rounds it for the
field: (dict "value" V "replicas" N "roundUp" BOOL). */}}
{{- define "pdserve.scaledCount" -}}
{{- if kindIs "string" .value }}
{{- $share := mulf (float64 (trimSuffix "%" .value)) (float64 .replicas) 0.01 }}
{{- if .roundUp }}{{ ceil $share | int }}{{ else }}{{ floor $share | int }}{{ end }}
{{- else }}
{{- int .value }}
{{- end }}
{{- end }}
