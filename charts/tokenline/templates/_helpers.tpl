{{/* Names and labels shared by the templates. */}}

{{- define "tokenline.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tokenline.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The operator's objects: "<fullname>-operator". */}}
{{- define "tokenline.operatorName" -}}
{{- printf "%s-operator" (include "tokenline.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tokenline.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "tokenline.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "tokenline.operatorSelectorLabels" -}}
app.kubernetes.io/name: {{ include "tokenline.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "tokenline.operatorLabels" -}}
{{ include "tokenline.labels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "tokenline.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tokenline.operatorName" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "tokenline.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The InferenceService `helm test` calls: tests.target, else the sample's name. */}}
{{- define "tokenline.testTarget" -}}
{{- if .Values.tests.target }}
{{- .Values.tests.target }}
{{- else if .Values.sample.enabled }}
{{- .Values.sample.name }}
{{- end }}
{{- end }}
