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

{{/*
The workers' sidecar container, as the injection webhook adds it and as the example worker
runs it by hand: (dict "root" $ "queue" "q"); an empty queue leaves LEASEHOLD_QUEUE to the
webhook. Its volumes are "leasehold.sidecarVolumes".
*/}}
{{- define "leasehold.sidecarContainer" -}}
{{- $root := .root -}}
name: leasehold-sidecar
image: {{ include "leasehold.image" $root }}
imagePullPolicy: {{ $root.Values.image.pullPolicy }}
restartPolicy: Always
args: ["sidecar"]
env:
  {{- if .queue }}
  - name: LEASEHOLD_QUEUE
    value: {{ .queue | quote }}
  {{- end }}
  - name: LEASEHOLD_LISTEN
    value: "127.0.0.1:7070"
  # Probes and Prometheus reach /readyz, /healthz and /metrics here; the worker API stays
  # on loopback.
  - name: LEASEHOLD_METRICS_ADDR
    value: "0.0.0.0:9091"
  # A native sidecar is stopped only after the worker container exited, so jobs still held
  # then can be released at once (requeued without waiting out a lease).
  - name: LEASEHOLD_RELEASE_ON_SHUTDOWN
    value: "true"
  # The sidecar's identity is the pod's name: it becomes status.holder, and the admission
  # policy accepts a claim only in the name of the requesting pod.
  - name: POD_NAME
    valueFrom:
      fieldRef:
        fieldPath: metadata.name
  - name: POD_NAMESPACE
    valueFrom:
      fieldRef:
        fieldPath: metadata.namespace
  # Where the controller advertises its dispatcher (docs/protocol.md, "Dispatch").
  - name: LEASEHOLD_DISPATCH_NAMESPACE
    value: {{ $root.Release.Namespace | quote }}
volumeMounts:
  # The token that proves this pod to the dispatcher: for its audience only, so the API
  # server refuses it for anything else; the kubelet rotates it.
  - name: leasehold-dispatcher-token
    mountPath: /var/run/secrets/leasehold.dev/dispatcher
    readOnly: true
  # The sidecar's own API credentials (the pod's ServiceAccount, bound to the pod), so it
  # works whatever the pod's automountServiceAccountToken says.
  - name: leasehold-api-access
    mountPath: /var/run/secrets/kubernetes.io/serviceaccount
    readOnly: true
# The worker container starts once the sidecar's watch has synced.
startupProbe:
  httpGet:
    path: /readyz
    port: 9091
  periodSeconds: 1
  failureThreshold: 60
livenessProbe:
  httpGet:
    path: /healthz
    port: 9091
ports:
  - name: metrics
    containerPort: 9091
securityContext:
  runAsNonRoot: true
  runAsUser: 65532
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities:
    drop: ["ALL"]
  seccompProfile:
    type: RuntimeDefault
{{- /* exampleWorker.sidecarResources, from before sidecar.resources, wins when set (a
release made by an older chart, upgraded with --reuse-values, has only it). */}}
{{- $old := dig "sidecarResources" dict ($root.Values.exampleWorker | default dict) }}
resources:
  {{- toYaml (ternary $old (dig "resources" dict ($root.Values.sidecar | default dict)) (not (empty $old))) | nindent 2 }}
{{- end }}

{{/* The sidecar's volumes (a list), for "leasehold.sidecarContainer". */}}
{{- define "leasehold.sidecarVolumes" -}}
- name: leasehold-dispatcher-token
  projected:
    sources:
      - serviceAccountToken:
          audience: leasehold-dispatcher
          expirationSeconds: 3600
          path: token
- name: leasehold-api-access
  projected:
    sources:
      - serviceAccountToken:
          expirationSeconds: 3607
          path: token
      - configMap:
          name: kube-root-ca.crt
          items:
            - key: ca.crt
              path: ca.crt
      - downwardAPI:
          items:
            - path: namespace
              fieldRef:
                fieldPath: metadata.namespace
{{- end }}

{{/* Whether sidecar injection is on (enabled, with the admission server, for some worker
namespaces): "true" or "". */}}
{{- define "leasehold.injection" -}}
{{- $inj := dig "injection" dict (.Values.sidecar | default dict) -}}
{{- if and (dig "enabled" false $inj) .Values.admissionWebhook.enabled .Values.workers.namespaces -}}true{{- end -}}
{{- end }}
