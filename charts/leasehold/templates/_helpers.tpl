{{/* Name of the chart, overridable. */}}
{{- define "leasehold.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Prefix of every resource name: the release name, plus the chart name unless it has it. */}}
{{- define "leasehold.fullname" -}}
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

{{/* Labels on every object of the release. */}}
{{- define "leasehold.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "leasehold.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: leasehold
{{- end }}

{{/* Selector labels of the controller's pods. */}}
{{- define "leasehold.controllerSelectorLabels" -}}
app.kubernetes.io/name: {{ include "leasehold.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: controller
{{- end }}

{{/* The controller's ServiceAccount. */}}
{{- define "leasehold.controllerServiceAccount" -}}
{{- $sa := .Values.controller.serviceAccount }}
{{- if $sa.name }}
{{- $sa.name }}
{{- else if or (not (hasKey $sa "create")) $sa.create }}
{{- printf "%s-controller" (include "leasehold.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- fail "controller.serviceAccount.name must name your own ServiceAccount when controller.serviceAccount.create is false" }}
{{- end }}
{{- end }}

{{/* The Service the API server calls the admission webhook through. */}}
{{- define "leasehold.admissionService" -}}
{{- printf "%s-admission" (include "leasehold.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The Secret holding the admission webhook's serving certificate, key and CA. */}}
{{- define "leasehold.admissionSecret" -}}
{{- printf "%s-admission-tls" (include "leasehold.fullname" .) | trunc 253 | trimSuffix "-" }}
{{- end }}

{{/* The image, tag defaulting to the chart's appVersion. */}}
{{- define "leasehold.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The example worker's image, tag defaulting to the chart's appVersion. */}}
{{- define "leasehold.exampleWorkerImage" -}}
{{- with .Values.exampleWorker.image }}
{{- printf "%s:%s" .repository (default $.Chart.AppVersion .tag) }}
{{- end }}
{{- end }}

{{/* Usernames the admission policies treat as workers, as a JSON (and so CEL) list. */}}
{{- define "leasehold.workerUsernames" -}}
{{- $users := list }}
{{- range .Values.workers.namespaces }}
{{- $users = append $users (printf "system:serviceaccount:%s:%s" . $.Values.workers.serviceAccountName) }}
{{- end }}
{{- range .Values.admissionPolicy.extraWorkerUsernames }}
{{- $users = append $users . }}
{{- end }}
{{- $users | toJson }}
{{- end }}

{{/* PromQL label matchers joined with commas, empty ones left out: (list "a=\"1\"" "" "b=\"2\"") -> a="1",b="2". */}}
{{- define "leasehold.matchers" -}}
{{- $parts := list }}
{{- range . }}
{{- if . }}
{{- $parts = append $parts . }}
{{- end }}
{{- end }}
{{- join "," $parts }}
{{- end }}
