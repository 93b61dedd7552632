{{/*
Names. The release's objects are "<fullname>-<component>"; with release name "tandem" they are
tandem-router, tandem-prefill, ... (the ControllerConfig defaults).
*/}}
{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else if contains "tandem" .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-tandem" .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* "<fullname>-<component>"; call with (dict "root" $ "component" "prefill"). */}}
{{- define "tandem.componentName" -}}
{{- printf "%s-%s" (include "tandem.fullname" .root) .component -}}
{{- end -}}

{{- define "tandem.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels every pod of this release carries; NetworkPolicies select on them. */}}
{{- define "tandem.releaseSelector" -}}
app.kubernetes.io/name: tandem
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Selector labels of one component; call with (dict "root" $ "component" "router"). */}}
{{- define "tandem.selectorLabels" -}}
{{ include "tandem.releaseSelector" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "tandem.labels" -}}
{{ include "tandem.selectorLabels" . }}
helm.sh/chart: {{ include "tandem.chart" .root }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: tandem
{{- end -}}

{{- define "tandem.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/*
The Redis URL every process gets: the bundled StatefulSet's Service, or redis.url.
*/}}
{{- define "tandem.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s:%d/0" (include "tandem.componentName" (dict "root" . "component" "redis")) (int .Values.redis.port) -}}
{{- else -}}
{{- required "redis.url is required when redis.enabled is false (e.g. redis://my-redis:6379/0)" .Values.redis.url -}}
{{- end -}}
{{- end -}}

{{/*
True ("true") when the controller scales the worker Deployments: then their manifests carry
no `replicas`, so `helm upgrade` does not undo the controller's decisions.
*/}}
{{- define "tandem.controllerScales" -}}
{{- if and .Values.controller.enabled (eq (.Values.controller.config.actuator | default "none") "kubernetes") -}}
true
{{- end -}}
{{- end -}}

{{/*
One TANDEM_* env value from a values entry. YAML integers arrive as float64 (2.68435456e+08
when printed plainly), so integral floats print as integers; `int` and `float` fields both
parse them. null prints "" (the flag parser reads it as None).
*/}}
{{- define "tandem.envValue" -}}
{{- if kindIs "invalid" . -}}
{{- else if kindIs "bool" . -}}
{{- ternary "true" "false" . -}}
{{- else if and (kindIs "float64" .) (eq . (floor .)) -}}
{{- printf "%d" (int64 .) -}}
{{- else -}}
{{- toString . -}}
{{- end -}}
{{- end -}}

{{/*
`<component>.config` as env: key `max_inflight` -> TANDEM_MAX_INFLIGHT, one-to-one with the
component's config dataclass (services/common/flags.py). Keys come sorted.
*/}}
{{- define "tandem.configEnv" -}}
{{- range $key, $value := . }}
- name: TANDEM_{{ upper $key }}
  value: {{ include "tandem.envValue" $value | quote }}
{{- end }}
{{- end -}}

{{/*
A gRPC health probe (grpc.health.v1.Health/Check, service ""). Kubernetes >= 1.24 checks it
natively; older clusters exec services.common.healthcheck in the container.
Call with (dict "root" $ "port" 50051 "probe" .Values.probes.readiness).
*/}}
{{- define "tandem.grpcProbe" -}}
{{- if semverCompare ">=1.24-0" .root.Capabilities.KubeVersion.Version }}
grpc:
  port: {{ .port }}
{{- else }}
exec:
  command:
    - {{ .root.Values.python }}
    - -m
    - services.common.healthcheck
    - --port
    - {{ .port | quote }}
    - --timeout-s
    - {{ max 1 (sub (int .probe.timeoutSeconds) 1) | quote }}
{{- end }}
{{ toYaml .probe }}
{{- end -}}

{{/* readiness, liveness and startup probes of a gRPC container; same arguments, plus
"startup": the component's own startupProbe keys, which override probes.startup (workers
load weights and warm up before they report SERVING: minutes on a GPU). */}}
{{- define "tandem.grpcProbes" -}}
{{- $startup := merge (deepCopy (.startup | default dict)) .root.Values.probes.startup }}
readinessProbe:
  {{- include "tandem.grpcProbe" (dict "root" .root "port" .port "probe" .root.Values.probes.readiness) | trim | nindent 2 }}
livenessProbe:
  {{- include "tandem.grpcProbe" (dict "root" .root "port" .port "probe" .root.Values.probes.liveness) | trim | nindent 2 }}
startupProbe:
  {{- include "tandem.grpcProbe" (dict "root" .root "port" .port "probe" $startup) | trim | nindent 2 }}
{{- end -}}

{{/* The model volume and its read-only mount (+ the generator init container when no
volume is given). */}}
{{- define "tandem.modelVolume" -}}
- name: model
{{- if .Values.model.volume }}
  {{- toYaml .Values.model.volume | nindent 2 }}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end -}}

{{- define "tandem.modelMount" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end -}}

{{- define "tandem.modelInit" -}}
{{- if not .Values.model.volume }}
- name: make-model
  image: {{ include "tandem.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: [tandem, make-tiny-model, {{ .Values.model.dir | quote }}, --preset, {{ .Values.model.tinyPreset | quote }}]
  {{- with .Values.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: model
      mountPath: {{ .Values.model.mountPath }}
{{- end }}
{{- end -}}

{{/* Chart-wide checks, included once from the router template. */}}
{{- define "tandem.validate" -}}
{{- if not (hasPrefix (printf "%s/" (trimSuffix "/" .Values.model.mountPath)) .Values.model.dir) -}}
{{- fail (printf "model.dir (%s) must lie under model.mountPath (%s)" .Values.model.dir .Values.model.mountPath) -}}
{{- end -}}
{{- if and .Values.redis.enabled .Values.redis.url -}}
{{- fail "set either redis.enabled (bundled Redis) or redis.url (external Redis), not both" -}}
{{- end -}}
{{- end -}}

{{/* Pod scheduling fields of a component's values. */}}
{{- define "tandem.scheduling" -}}
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
{{- end -}}
