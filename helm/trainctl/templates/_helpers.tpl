{{- define "trainctl.fullname" -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "trainctl.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "trainctl.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* dp * cp * tp * pp: one rank per GPU. */}}
{{- define "trainctl.worldSize" -}}
{{ mul .Values.layout.dp .Values.layout.cp .Values.layout.tp .Values.layout.pp }}
{{- end -}}

{{- define "trainctl.workerReplicas" -}}
{{- $world := include "trainctl.worldSize" . | int -}}
{{- $per := .Values.workers.gpusPerPod | int -}}
{{- if ne (mod $world $per) 0 -}}
{{- fail (printf "layout needs %d GPUs (dp*cp*tp*pp), not a multiple of workers.gpusPerPod=%d: change the layout or gpusPerPod" $world $per) -}}
{{- end -}}
{{ div $world $per }}
{{- end -}}

{{- define "trainctl.secretName" -}}
{{ .Values.auth.existingSecret | default (printf "%s-auth" (include "trainctl.fullname" .)) }}
{{- end -}}

{{- define "trainctl.volumes" -}}
{{- if .Values.auth.apiKeysSecret }}
- name: api-keys
  secret:
    secretName: {{ .Values.auth.apiKeysSecret }}
    items: [{key: api-keys, path: api-keys}]
{{- end }}
{{- if .Values.profiles.enabled }}
- name: profiles
  persistentVolumeClaim:
    claimName: {{ .Values.profiles.existingClaim | default (printf "%s-profiles" (include "trainctl.fullname" .)) }}
{{- end }}
{{- if .Values.checkpoints.enabled }}
- name: checkpoints
  persistentVolumeClaim:
    claimName: {{ .Values.checkpoints.existingClaim | default (printf "%s-checkpoints" (include "trainctl.fullname" .)) }}
{{- end }}
{{- end -}}

{{- define "trainctl.volumeMounts" -}}
{{- if .Values.auth.apiKeysSecret }}
- name: api-keys
  mountPath: /etc/trainctl/keys
  readOnly: true
{{- end }}
{{- if .Values.profiles.enabled }}
- name: profiles
  mountPath: {{ .Values.profiles.mountPath }}
{{- end }}
{{- if .Values.checkpoints.enabled }}
- name: checkpoints
  mountPath: {{ .Values.checkpoints.mountPath }}
{{- end }}
{{- end -}}

{{- define "trainctl.raySecretName" -}}
{{ printf "%s-ray" (include "trainctl.fullname" .) }}
{{- end -}}

{{/* Every pod: Ray's token auth. */}}
{{- define "trainctl.rayEnv" -}}
{{- if .Values.ray.tokenAuth }}
- {name: RAY_AUTH_MODE, value: token}
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "trainctl.raySecretName" . }}
      key: token
{{- end }}
{{- end -}}

{{/* The head pod: the gateway's API token, and Ray's. */}}
{{- define "trainctl.env" -}}
{{- if .Values.auth.enabled }}
- name: TRAINCTL_API_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "trainctl.secretName" . }}
      key: token
{{- end }}
{{ include "trainctl.rayEnv" . }}
{{- end -}}
