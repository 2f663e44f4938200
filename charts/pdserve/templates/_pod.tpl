{{/*
The Deployment of one pdserve role, shared by the router and the worker pools: the same
pod shape (security, model volume, probes, drain) with the role's arguments, ports,
environment, account and resources.

Called with (dict "root" $ "role" "decode" "spec" .Values.decode).
*/}}
{{- define "pdserve.deployment" -}}
{{- $root := .root }}
{{- $spec := .spec }}
{{- $component := dict "root" $root "component" .role }}
{{- include "pdserve.checkRollout" . }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "pdserve.componentName" $component }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "pdserve.componentLabels" $component | nindent 4 }}
spec:
  {{- /* an autoscaler's or the planner's to set: an upgrade would reset it */}}
  {{- if not (or $spec.autoscaling.enabled (include "pdserve.plannerScales" .)) }}
  replicas: {{ $spec.replicas }}
  {{- end }}
  revisionHistoryLimit: 5
  # One pod at a time, never the whole role: a stopping pod drains first (preStop,
  # then PDSERVE_GRACE seconds for its running requests).
  strategy:
    type: RollingUpdate
    rollingUpdate:
      {{- toYaml $spec.rollingUpdate | nindent 6 }}
  selector:
    matchLabels:
      {{- include "pdserve.componentSelectorLabels" $component | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "pdserve.componentSelectorLabels" $component | nindent 8 }}
        app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
        {{- with $spec.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- $annotations := include "pdserve.podChecksums" $root | fromYaml }}
      {{- $annotations = merge $annotations (deepCopy $spec.podAnnotations) }}
      {{- with $annotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      {{- include "pdserve.podSpec" . | trim | nindent 6 }}
{{- end }}

{{/* Refuses a rolling update that could stop every pod of a role at once: no surge pod
and maxUnavailable as many as the role's fewest pods. */}}
{{- define "pdserve.checkRollout" -}}
{{- $replicas := include "pdserve.minReplicas" . | int }}
{{- $rolling := .spec.rollingUpdate }}
{{- $surge := include "pdserve.scaledCount" (dict "value" ($rolling.maxSurge | default 0) "replicas" $replicas "roundUp" true) | int }}
{{- $down := include "pdserve.scaledCount" (dict "value" ($rolling.maxUnavailable | default 0) "replicas" $replicas "roundUp" false) | int }}
{{- if and (gt $replicas 0) (eq $surge 0) (ge $down $replicas) }}
{{- fail (printf "%s.rollingUpdate: maxUnavailable %v with no surge pod would stop all %d of its pods at once; run more replicas, lower maxUnavailable, or allow a surge (maxSurge)" .role $rolling.maxUnavailable $replicas) }}
{{- end }}
{{- end }}

{{/* Annotations that roll the pods when a configuration they read but do not show
changes: the Redis password the chart's Secret holds when it is given in values (a
generated one never changes). Salted with the release, so that the annotation is no
plain hash of the password. */}}
{{- define "pdserve.podChecksums" -}}
{{- if and .Values.redis.enabled (not .Values.redis.auth.existingSecret) .Values.redis.auth.password }}
checksum/redis-auth: {{ printf "%s/%s/%s" .Release.Namespace .Release.Name .Values.redis.auth.password | sha256sum }}
{{- end }}
{{- end }}

{{- define "pdserve.podSpec" -}}
{{- $root := .root }}
{{- $spec := .spec }}
{{- $isRouter := eq .role "router" }}
{{- $watchesEndpoints := and $isRouter (include "pdserve.kubernetesDiscovery" $root) }}
serviceAccountName: {{ ternary (include "pdserve.routerServiceAccount" $root) (include "pdserve.workerServiceAccount" $root) $isRouter }}
# Only a router with Kubernetes discovery talks to the API server.
automountServiceAccountToken: {{ if $watchesEndpoints }}true{{ else }}false{{ end }}
# Service links would put <SERVICE>_PORT variables beside ours (PDSERVE_PORT among them
# for a Service called pdserve): none.
enableServiceLinks: false
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
{{- with $spec.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with $spec.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
terminationGracePeriodSeconds: {{ include "pdserve.terminationGracePeriod" $spec }}
{{- with $spec.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $spec.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $spec.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $spec.topologySpreadConstraints }}
{{- $constraints := list }}
{{- range . }}
{{- $constraint := deepCopy . }}
{{- if not $constraint.labelSelector }}
{{- $_ := set $constraint "labelSelector" (dict "matchLabels" (include "pdserve.componentSelectorLabels" (dict "root" $root "component" $.role) | fromYaml)) }}
{{- end }}
{{- $constraints = append $constraints $constraint }}
{{- end }}
topologySpreadConstraints:
  {{- toYaml $constraints | nindent 2 }}
{{- end }}
{{- if eq $root.Values.model.source "image" }}
initContainers:
  {{- include "pdserve.modelCopyContainer" $root | trim | nindent 2 }}
{{- end }}
containers:
  - name: {{ .role }}
    image: {{ include "pdserve.image" . | quote }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    args:
      {{- if $isRouter }}
      - router
      {{- else }}
      - serve
      - {{ .role }}
      {{- end }}
      {{- range $spec.extraArgs }}
      - {{ . | quote }}
      {{- end }}
    ports:
      - name: grpc
        containerPort: {{ $root.Values.ports.grpc }}
        protocol: TCP
      {{- if and $isRouter $spec.http.enabled }}
      - name: http
        containerPort: {{ $root.Values.ports.http }}
        protocol: TCP
      {{- end }}
      {{- if $root.Values.metrics.enabled }}
      - name: metrics
        containerPort: {{ $root.Values.ports.metrics }}
        protocol: TCP
      {{- end }}
      {{- if $root.Values.tls.enabled }}
      - name: health
        containerPort: {{ $root.Values.ports.health }}
        protocol: TCP
      {{- end }}
      {{- if include "pdserve.kvPort" . }}
      - name: kv
        containerPort: {{ $root.Values.ports.kv }}
        protocol: TCP
      {{- end }}
    env:
      {{- include "pdserve.env" . | trim | nindent 6 }}
    {{- with $spec.extraEnvFrom }}
    envFrom:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    resources:
      {{- include "pdserve.resources" (dict "root" $root "spec" $spec "isRouter" $isRouter) | trim | nindent 6 }}
    {{- include "pdserve.probes" (dict "root" $root "probes" $spec.probes) | trim | nindent 4 }}
    {{- if $spec.preStopSleepSeconds }}
    # Serve on while this pod leaves the Services, load balancers and the registry; the
    # drain (PDSERVE_GRACE) starts with the SIGTERM after it.
    lifecycle:
      preStop:
        sleep:
          seconds: {{ $spec.preStopSleepSeconds }}
    {{- end }}
    securityContext:
      {{- toYaml $root.Values.securityContext | nindent 6 }}
    volumeMounts:
      {{- include "pdserve.modelMount" $root | trim | nindent 6 }}
      - name: tmp
        mountPath: /tmp
      - name: home
        mountPath: /home/pdserve
      {{- if $root.Values.tls.enabled }}
      - name: tls
        mountPath: {{ $root.Values.tls.mountPath }}
        readOnly: true
      {{- end }}
      {{- if and $isRouter $root.Values.apiKeys.enabled }}
      - name: api-keys
        mountPath: {{ $root.Values.apiKeys.mountPath }}
        readOnly: true
      {{- end }}
      {{- with $spec.extraVolumeMounts }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
volumes:
  {{- include "pdserve.modelVolume" $root | trim | nindent 2 }}
  - name: tmp
    emptyDir:
      sizeLimit: {{ $root.Values.tmpSizeLimit }}
  - name: home
    emptyDir:
      sizeLimit: {{ $root.Values.tmpSizeLimit }}
  {{- if $root.Values.tls.enabled }}
  - name: tls
    secret:
      secretName: {{ include "pdserve.tlsSecretName" (dict "root" $root "role" .role) }}
      defaultMode: 0440
      items:
        - {key: tls.crt, path: tls.crt}
        - {key: tls.key, path: tls.key}
        - {key: ca.crt, path: ca.crt}
  {{- end }}
  {{- if and $isRouter $root.Values.apiKeys.enabled }}
  - name: api-keys
    secret:
      secretName: {{ $root.Values.apiKeys.existingSecret }}
      defaultMode: 0440
      items:
        - {key: {{ $root.Values.apiKeys.key }}, path: {{ $root.Values.apiKeys.key }}}
  {{- end }}
  {{- with $spec.extraVolumes }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}

{{/* A role's resources, with its pool's GPUs as the extended resource gpu.resourceName
(a limit only: the scheduler takes it as the request too). */}}
{{- define "pdserve.resources" -}}
{{- $resources := deepCopy (.spec.resources | default dict) }}
{{- if and (not .isRouter) (gt (int .spec.gpus) 0) }}
{{- $limits := deepCopy ($resources.limits | default dict) }}
{{- $_ := set $limits .root.Values.gpu.resourceName (toString (int .spec.gpus)) }}
{{- $_ := set $resources "limits" $limits }}
{{- end }}
{{- toYaml $resources }}
{{- end }}

{{/* Native gRPC probes of the standard grpc.health.v1 service, which a pdserve server
answers NOT_SERVING until its model is loaded and again while it drains: the startup
probe waits out the loading, readiness takes a draining pod out of its Services, and
liveness restarts a server that stopped answering. The kubelet speaks plaintext, so under
TLS they ask the health-only port. */}}
{{- define "pdserve.probes" -}}
{{- $port := include "pdserve.healthPort" .root }}
{{- range $probe := list "startup" "liveness" "readiness" }}
{{ $probe }}Probe:
  grpc:
    port: {{ $port }}
  {{- toYaml (index $.probes $probe) | nindent 2 }}
{{- end }}
{{- end }}
