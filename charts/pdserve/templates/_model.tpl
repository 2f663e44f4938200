{{/*
The model directory: one volume, mounted read-only at model.path in every pdserve pod,
whichever its source (model.source).
*/}}

{{/* The PVC this chart makes for the model (source persistentVolumeClaim). */}}
{{- define "pdserve.modelClaimName" -}}
{{- printf "%s-model" (include "pdserve.fullname" .) }}
{{- end }}

{{- define "pdserve.modelVolume" -}}
{{- $model := .Values.model }}
- name: model
{{- if eq $model.source "existingClaim" }}
  persistentVolumeClaim:
    claimName: {{ $model.existingClaim.claimName }}
    readOnly: true
{{- else if eq $model.source "persistentVolumeClaim" }}
  persistentVolumeClaim:
    claimName: {{ include "pdserve.modelClaimName" . }}
    readOnly: true
{{- else if eq $model.source "hostPath" }}
  hostPath:
    path: {{ $model.hostPath.path }}
    {{- with $model.hostPath.type }}
    type: {{ . }}
    {{- end }}
{{- else if eq $model.source "image" }}
  # filled by the copy-model init container
  emptyDir:
    {{- with $model.image.sizeLimit }}
    sizeLimit: {{ . }}
    {{- else }} {}
    {{- end }}
{{- end }}
{{- end }}

{{- define "pdserve.modelMount" -}}
- name: model
  mountPath: {{ .Values.model.path }}
  readOnly: true
  {{- if and .Values.model.subPath (ne .Values.model.source "image") }}
  subPath: {{ .Values.model.subPath }}
  {{- end }}
{{- end }}

{{/* Source image: an init container fills the pod's `model` emptyDir from the model's
image: `cp -R` of model.image.path (the image must have cp), or model.image.command,
which writes the directory to /pdserve-model. */}}
{{- define "pdserve.modelCopyContainer" -}}
{{- $image := .Values.model.image }}
- name: copy-model
  image: {{ printf "%s:%s" $image.repository $image.tag | quote }}
  imagePullPolicy: {{ $image.pullPolicy }}
  {{- if $image.command }}
  command:
    {{- toYaml $image.command | nindent 4 }}
  {{- else }}
  command: [cp, -R, {{ printf "%s/." (trimSuffix "/" $image.path) | quote }}, /pdserve-model/]
  {{- end }}
  {{- with $image.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
    - name: model
      mountPath: /pdserve-model
    - name: tmp
      mountPath: /tmp
    - name: home
      mountPath: /home/pdserve
{{- end }}
