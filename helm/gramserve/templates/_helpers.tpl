{{/* Names, labels and the pieces every component's pod spec shares. */}}

{{- define "gramserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Resource name prefix; component names append "-gateway", "-grammar", "-worker". */}}
{{- define "gramserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "gramserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "gramserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels of one component; call with (dict "root" $ "component" "gateway"). */}}
{{- define "gramserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gramserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "gramserve.componentLabels" -}}
{{ include "gramserve.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "gramserve.gatewayName" -}}{{ include "gramserve.fullname" . }}-gateway{{- end }}
{{- define "gramserve.grammarName" -}}{{ include "gramserve.fullname" . }}-grammar{{- end }}
{{- define "gramserve.workerName" -}}{{ include "gramserve.fullname" . }}-worker{{- end }}

{{- define "gramserve.cpuImage" -}}
{{ .Values.image.cpu.repository }}:{{ .Values.image.cpu.tag | default .Chart.AppVersion }}
{{- end }}
{{- define "gramserve.cudaImage" -}}
{{ .Values.image.cuda.repository }}:{{ .Values.image.cuda.tag | default .Chart.AppVersion }}
{{- end }}

{{/* --model as every process sees it. */}}
{{- define "gramserve.modelPath" -}}
{{ .Values.model.mountPath }}/{{ .Values.model.subPath }}
{{- end }}

{{/* The grammar service's address, dialled by the gateway and every worker rank. */}}
{{- define "gramserve.grammarAddress" -}}
{{ include "gramserve.grammarName" . }}:{{ .Values.grammarService.port }}
{{- end }}

{{/* Stable DNS name of worker pod $i behind the headless Service; call with (list $ $i). */}}
{{- define "gramserve.workerHost" -}}
{{- $root := index . 0 }}
{{- $w := include "gramserve.workerName" $root }}
{{- printf "%s-%d.%s.%s.svc.%s" $w (index . 1) $w $root.Release.Namespace $root.Values.clusterDomain }}
{{- end }}

{{/*
The gateway's --group value: one ';'-separated entry per worker pod (TP group), each the
','-separated addresses of that pod's ranks (rank r on port + r), in rank order.
*/}}
{{- define "gramserve.groupList" -}}
{{- $root := . }}
{{- $groups := list }}
{{- range $g := until (int .Values.worker.groups) }}
{{- $host := include "gramserve.workerHost" (list $root $g) }}
{{- $ranks := list }}
{{- range $r := until (int $root.Values.worker.tp) }}
{{- $ranks = append $ranks (printf "%s:%d" $host (add $root.Values.worker.port $r)) }}
{{- end }}
{{- $groups = append $groups (join "," $ranks) }}
{{- end }}
{{- join ";" $groups }}
{{- end }}

{{/* TLS flags: "server" adds cert and key, "client" adds the CA; call with (dict "root" $ "server" true "client" true). */}}
{{- define "gramserve.tlsArgs" -}}
{{- if .root.Values.tls.enabled }}
{{- $dir := .root.Values.tls.mountPath }}
{{- if .server }}
- --tls-cert
- {{ $dir }}/tls.crt
- --tls-key
- {{ $dir }}/tls.key
{{- end }}
{{- if .client }}
- --tls-ca
- {{ $dir }}/ca.crt
{{- end }}
{{- if .root.Values.tls.mutual }}
{{- if .internalServer }}
- --tls-client-ca
- {{ $dir }}/ca.crt
{{- end }}
{{- if .gateway }}
- --tls-client-cert
- {{ $dir }}/tls.crt
- --tls-client-key
- {{ $dir }}/tls.key
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Flags every component takes: /metrics on the pod address (Prometheus scrapes it; the
processes bind loopback unless told), and gRPC reflection off unless enabled.
*/}}
{{- define "gramserve.commonArgs" -}}
- --metrics-host
- 0.0.0.0
{{- if not .Values.reflection }}
- --reflection
- "off"
{{- end }}
{{- end }}

{{/*
liveness, readiness and startup probes against grpc.health.v1 on one port.
Kubelet's native gRPC probe speaks plaintext only, so with TLS on the same check runs as an
exec probe (grpc_health_probe.py from the image) that trusts the chart's CA and verifies
the certificate against `serverName`. Call with (dict "root" $ "port" N "serverName" S).
*/}}
{{- define "gramserve.probes" -}}
{{- $p := .root.Values.probes }}
{{- $check := dict }}
{{- if .root.Values.tls.enabled }}
{{- $cmd := list "python" "/opt/gramserve/grpc_health_probe.py" "--port" (toString .port) "--tls-ca" (printf "%s/ca.crt" .root.Values.tls.mountPath) "--server-name" .serverName "--timeout" (toString $p.timeoutSeconds) }}
{{- if .root.Values.tls.mutual }}
{{- $cmd = concat $cmd (list "--tls-cert" (printf "%s/tls.crt" .root.Values.tls.mountPath) "--tls-key" (printf "%s/tls.key" .root.Values.tls.mountPath)) }}
{{- end }}
{{- $check = dict "exec" (dict "command" $cmd) }}
{{- else }}
{{- $check = dict "grpc" (dict "port" (int .port)) }}
{{- end }}
{{- $timing := dict "periodSeconds" $p.periodSeconds "timeoutSeconds" $p.timeoutSeconds "failureThreshold" $p.failureThreshold }}
startupProbe:
{{- toYaml (merge (dict "failureThreshold" $p.startupFailureThreshold) $check $timing) | nindent 2 }}
livenessProbe:
{{- toYaml (merge (dict) $check $timing) | nindent 2 }}
readinessProbe:
{{- toYaml (merge (dict) $check $timing) | nindent 2 }}
{{- end }}

{{/* Volumes every pod mounts: the model (read-only), writable /tmp, and the TLS Secret. */}}
{{- define "gramserve.commonVolumes" -}}
- name: model
{{- if eq .Values.model.source "hostPath" }}
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    type: Directory
{{- else }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- end }}
- name: tmp
  emptyDir: {}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
{{- end }}
{{- end }}

{{/* The bearer-token Secret, mounted into the gateway only. */}}
{{- define "gramserve.authVolume" -}}
{{- if .Values.auth.enabled }}
- name: auth
  secret:
    secretName: {{ .Values.auth.secretName }}
    items:
      - key: {{ .Values.auth.secretKey }}
        path: tokens
{{- end }}
{{- end }}

{{- define "gramserve.commonMounts" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ .Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/* Caches that libraries write to $HOME by default, redirected to the writable /tmp. */}}
{{- define "gramserve.commonEnv" -}}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /tmp/cache
- name: TRITON_CACHE_DIR
  value: /tmp/triton
{{- end }}

{{/* Pod scheduling fields of one component's values; call with the component's values. */}}
{{- define "gramserve.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* PodDisruptionBudget body fields; call with the component's pdb values. */}}
{{- define "gramserve.pdbBudget" -}}
{{- if .minAvailable }}
minAvailable: {{ .minAvailable }}
{{- else }}
maxUnavailable: {{ .maxUnavailable | default 1 }}
{{- end }}
{{- end }}
