{{/* Names, labels and the pieces every workload shares. */}}

{{- define "rackserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "rackserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "rackserve.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "rackserve.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* selector labels of one component: (dict "root" $ "component" "decode") */}}
{{- define "rackserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rackserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "rackserve.labels" -}}
{{ include "rackserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: rackserve
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "rackserve.image" -}}
{{- if .digest -}}
{{ .repository }}@{{ .digest }}
{{- else -}}
{{ .repository }}:{{ .tag }}
{{- end -}}
{{- end -}}

{{- define "rackserve.serviceAccountName" -}}
{{- if .root.Values.serviceAccount.create -}}
{{ include "rackserve.fullname" .root }}-{{ .component }}
{{- else -}}
default
{{- end -}}
{{- end -}}

{{/* etcd endpoints every service gets as --etcd */}}
{{- define "rackserve.etcdEndpoints" -}}
{{- if eq .Values.etcd.mode "external" -}}
{{- join "," .Values.etcd.external.endpoints -}}
{{- else -}}
{{- $fullname := include "rackserve.fullname" . -}}
{{- $eps := list -}}
{{- range $i := until (int .Values.etcd.replicas) -}}
{{- $eps = append $eps (printf "http://%s-etcd-%d.%s-etcd-headless.%s.svc:2379" $fullname $i $fullname $.Release.Namespace) -}}
{{- end -}}
{{- join "," $eps -}}
{{- end -}}
{{- end -}}

{{/*
One env var per flag: a map {flag-name: value} -> RACKSERVE_FLAG_NAME. Whole numbers print as integers (YAML
numbers arrive as float64 and would otherwise print as 1.073741824e+09); null values are left out.
*/}}
{{- define "rackserve.flagEnv" -}}
{{- range $flag, $value := . }}
{{- if not (kindIs "invalid" $value) }}
{{- $text := toString $value }}
{{- if and (kindIs "float64" $value) (eq ($value | int64 | float64) $value) }}
{{- $text = $value | int64 | toString }}
{{- end }}
- name: {{ printf "RACKSERVE_%s" ($flag | upper | replace "-" "_") }}
  value: {{ $text | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* env every rackserve service gets: etcd, its security options, TLS files */}}
{{- define "rackserve.commonEnv" -}}
- name: RACKSERVE_ETCD
  value: {{ include "rackserve.etcdEndpoints" . | quote }}
- name: HF_HUB_OFFLINE
  value: "1"
- name: HOME
  value: /tmp
{{- if .Values.tls.enabled }}
- name: RACKSERVE_TLS_CERT_FILE
  value: /etc/rackserve/tls/tls.crt
- name: RACKSERVE_TLS_KEY_FILE
  value: /etc/rackserve/tls/tls.key
- name: RACKSERVE_TLS_CA_FILE
  value: /etc/rackserve/tls/ca.crt
- name: RACKSERVE_TLS_SERVER_NAME
  value: {{ .Values.tls.serverName | quote }}
{{- end }}
{{- if eq .Values.etcd.mode "external" }}
{{- with .Values.etcd.external }}
{{- if .tlsSecret }}
- name: RACKSERVE_ETCD_CA_FILE
  value: /etc/rackserve/etcd-tls/ca.crt
{{- if .clientCert }}
- name: RACKSERVE_ETCD_CERT_FILE
  value: /etc/rackserve/etcd-tls/tls.crt
- name: RACKSERVE_ETCD_KEY_FILE
  value: /etc/rackserve/etcd-tls/tls.key
{{- end }}
{{- end }}
{{- if .username }}
- name: RACKSERVE_ETCD_USERNAME
  value: {{ .username | quote }}
- name: RACKSERVE_ETCD_PASSWORD_FILE
  value: /etc/rackserve/etcd-auth/password
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* volumes every rackserve service mounts: /tmp (read-only root fs), TLS, etcd credentials */}}
{{- define "rackserve.commonVolumes" -}}
- name: tmp
  emptyDir: {}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ required "tls.secretName is required when tls.enabled" .Values.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- if eq .Values.etcd.mode "external" }}
{{- with .Values.etcd.external }}
{{- if .tlsSecret }}
- name: etcd-tls
  secret:
    secretName: {{ .tlsSecret }}
    defaultMode: 0440
{{- end }}
{{- if .username }}
- name: etcd-auth
  secret:
    secretName: {{ required "etcd.external.passwordSecret is required with etcd.external.username" .passwordSecret }}
    defaultMode: 0440
    items:
      - key: {{ .passwordKey }}
        path: password
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "rackserve.commonMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/rackserve/tls
  readOnly: true
{{- end }}
{{- if eq .Values.etcd.mode "external" }}
{{- if .Values.etcd.external.tlsSecret }}
- name: etcd-tls
  mountPath: /etc/rackserve/etcd-tls
  readOnly: true
{{- end }}
{{- if .Values.etcd.external.username }}
- name: etcd-auth
  mountPath: /etc/rackserve/etcd-auth
  readOnly: true
{{- end }}
{{- end }}
{{- end -}}

{{/* the model volume (nothing for source=image) */}}
{{- define "rackserve.modelVolume" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required when model.source=pvc" $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ required "model.hostPath.path is required when model.source=hostPath" $m.hostPath.path }}
    type: {{ $m.hostPath.type }}
{{- else if eq $m.source "initContainer" }}
- name: model
  emptyDir:
    sizeLimit: {{ $m.initContainer.sizeLimit }}
{{- end }}
{{- end -}}

{{- define "rackserve.modelMount" -}}
{{- if ne .Values.model.source "image" }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "rackserve.modelInit" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "initContainer" }}
- name: fetch-model
  image: {{ required "model.initContainer.image is required when model.source=initContainer" $m.initContainer.image }}
  command: {{ toJson $m.initContainer.command }}
  env:
    - name: MODEL_DIR
      value: {{ $m.mountPath | quote }}
    - name: HOME
      value: /tmp
  securityContext: {{ toJson .Values.containerSecurityContext }}
  resources: {{ toJson $m.initContainer.resources }}
  volumeMounts:
    - name: model
      mountPath: {{ $m.mountPath }}
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end -}}

{{- define "rackserve.terminationGracePeriod" -}}
{{- add (int .Values.drainGraceSeconds) (int .Values.terminationMarginSeconds) -}}
{{- end -}}

{{/* the frontend's preStop sleep, then its drain: its requests' deadline (--request-timeout-s, 600 s unset) plus a
stalled client's 10 s */}}
{{- define "rackserve.frontendTerminationGracePeriod" -}}
{{- $timeout := index .Values.frontend.flags "request-timeout-s" | default 600 | float64 | ceil | int -}}
{{- add (int .Values.frontend.preStopSleepSeconds) $timeout 10 (int .Values.terminationMarginSeconds) -}}
{{- end -}}

{{/* gRPC probes on the health port: (dict "root" $ "startup" .startupProbe) */}}
{{- define "rackserve.grpcProbes" -}}
{{- $root := .root -}}
startupProbe:
  grpc:
    port: {{ $root.Values.healthPort }}
  periodSeconds: {{ .startup.periodSeconds }}
  failureThreshold: {{ .startup.failureThreshold }}
readinessProbe:
  grpc:
    port: {{ $root.Values.healthPort }}
  periodSeconds: 5
  failureThreshold: 2
livenessProbe:
  grpc:
    port: {{ $root.Values.healthPort }}
  periodSeconds: 10
  timeoutSeconds: 5
  # NOT_SERVING while draining: liveness must outlast a whole drain, or the kubelet would cut it short
  failureThreshold: {{ add 3 (div (add (int $root.Values.drainGraceSeconds) 9) 10) }}
{{- end -}}

{{/* env of a traced service (frontend, router, workers): where its spans go */}}
{{- define "rackserve.tracingEnv" -}}
{{- with .Values.tracing.otlpEndpoint }}
- name: RACKSERVE_OTLP_ENDPOINT
  value: {{ . | quote }}
{{- end }}
{{- end -}}

{{/* env of a gRPC service pod: listen on and register the pod IP, fixed ports, drain grace */}}
{{- define "rackserve.serviceEnv" -}}
- name: RACKSERVE_HOST
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: RACKSERVE_PORT
  value: {{ .Values.grpcPort | quote }}
- name: RACKSERVE_HEALTH_PORT
  value: {{ .Values.healthPort | quote }}
- name: RACKSERVE_METRICS_PORT
  value: {{ .Values.metricsPort | quote }}
- name: RACKSERVE_WORKER_ID
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: RACKSERVE_NODE
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
- name: RACKSERVE_DRAIN_GRACE_S
  value: {{ .Values.drainGraceSeconds | quote }}
{{- end -}}

{{- /* A pod template's annotations: the scrape annotations for its metrics port (metrics.scrapeAnnotations) under
the user's podAnnotations, which win. Call with (dict "root" $ "port" <metrics port> "extra" <podAnnotations>). */ -}}
{{- define "rackserve.podAnnotations" -}}
{{- $a := dict -}}
{{- if .root.Values.metrics.scrapeAnnotations -}}
{{- $a = dict "prometheus.io/scrape" "true" "prometheus.io/port" (toString .port) "prometheus.io/path" "/metrics" -}}
{{- end -}}
{{- $a = merge (deepCopy (.extra | default dict)) $a -}}
{{- with $a }}
annotations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
