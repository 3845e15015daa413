{{/* Names and labels, in the shape of the community charts. */}}

{{- define "loraplex.name" -}}
{{ .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end -}}

{{- define "loraplex.fullname" -}}
{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end -}}

{{- define "loraplex.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/name: {{ include "loraplex.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "loraplex.operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "loraplex.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "loraplex.nodeAgent.selectorLabels" -}}
app.kubernetes.io/name: {{ include "loraplex.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: node-agent
{{- end -}}

{{- define "loraplex.operator.image" -}}
{{ .Values.operator.image.repository }}:{{ .Values.operator.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "loraplex.nodeAgent.image" -}}
{{ .Values.nodeAgent.image.repository }}:{{ .Values.nodeAgent.image.tag | default .Chart.AppVersion }}
{{- end -}}
