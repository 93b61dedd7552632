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

{{/*
The Tandem image: image.tag when set, else "<appVersion>-<image.variant>", the tag
`make image VARIANT=<variant>` gives (localhost/tandem:0.1.0-cpu, localhost/tandem:0.1.0-cuda).
*/}}
{{- define "tandem.image" -}}
{{- if .Values.image.tag -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.tag -}}
{{- else -}}
{{- printf "%s:%s-%s" .Values.image.repository .Chart.AppVersion (.Values.image.variant | default "cpu") -}}
{{- end -}}
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

{{/*
Where the model comes from, one of:
  volume     model.volume, a pod volume source mounted read-only at model.mountPath
  baked      model.baked: the model is at model.dir inside the image (no volume, no init)
  generated  neither: an init container writes the demo model into an emptyDir
*/}}
{{- define "tandem.modelSource" -}}
{{- if .Values.model.baked -}}
baked
{{- else if .Values.model.volume -}}
volume
{{- else -}}
generated
{{- end -}}
{{- end -}}

{{/*
A pod's volumes: the model's (unless baked), the workers' memory-backed /dev/shm (with
transfer.shmSizeLimit), then the component's extraVolumes. Empty when there are none.
Call with (dict "root" $ "model" true "shm" false "extra" .extraVolumes).
*/}}
{{- define "tandem.volumes" -}}
{{- $values := .root.Values }}
{{- if and .model (ne (include "tandem.modelSource" .root) "baked") }}
- name: model
{{- if $values.model.volume }}
  {{- toYaml $values.model.volume | nindent 2 }}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end }}
{{- if and .shm $values.transfer.shmSizeLimit }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ $values.transfer.shmSizeLimit }}
{{- end }}
{{- with .extra }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The main container's volumeMounts matching tandem.volumes (same arguments, "extra":
the component's extraVolumeMounts). */}}
{{- define "tandem.volumeMounts" -}}
{{- $values := .root.Values }}
{{- if and .model (ne (include "tandem.modelSource" .root) "baked") }}
- name: model
  mountPath: {{ $values.model.mountPath }}
  readOnly: true
{{- end }}
{{- if and .shm $values.transfer.shmSizeLimit }}
- name: dshm
  mountPath: /dev/shm
{{- end }}
{{- with .extra }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "tandem.modelInit" -}}
{{- if eq (include "tandem.modelSource" .) "generated" }}
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
{{- if and .Values.model.baked .Values.model.volume -}}
{{- fail "set either model.baked (the model is in the image) or model.volume, not both" -}}
{{- end -}}
{{- if and (not .Values.model.baked) (not (hasPrefix (printf "%s/" (trimSuffix "/" .Values.model.mountPath)) .Values.model.dir)) -}}
{{- fail (printf "model.dir (%s) must lie under model.mountPath (%s)" .Values.model.dir .Values.model.mountPath) -}}
{{- end -}}
{{- if and .Values.redis.enabled .Values.redis.url -}}
{{- fail "set either redis.enabled (bundled Redis) or redis.url (external Redis), not both" -}}
{{- end -}}
{{- end -}}

{{/* Pod scheduling fields of a component's values (nodeSelector, tolerations, affinity). */}}
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

{{/*
Pod settings of a Tandem component (router, prefill, decode, controller): runtimeClassName,
priorityClassName and the scheduling fields, plus the placement preset for the workers. With
placement.colocatePools a prefill pod prefers a topology domain (placement.topologyKey) that
holds decode pods and vice versa, so KV moves over the local fabric, and each worker role
spreads its own pods across nodes. The preset's pod-affinity term is appended to the
component's own `affinity`, which stays as given otherwise.
Call with (dict "root" $ "component" "prefill" "values" .Values.prefill).
*/}}
{{- define "tandem.podSettings" -}}
{{- $values := .values }}
{{- with $values.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with $values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- $affinity := deepCopy ($values.affinity | default dict) }}
{{- $spread := list }}
{{- $peer := get (dict "prefill" "decode" "decode" "prefill") .component }}
{{- if and .root.Values.placement.colocatePools $peer }}
{{- $peerLabels := include "tandem.selectorLabels" (dict "root" .root "component" $peer) | fromYaml }}
{{- $term := dict "weight" 100 "podAffinityTerm" (dict "labelSelector" (dict "matchLabels" $peerLabels) "topologyKey" .root.Values.placement.topologyKey) }}
{{- $podAffinity := get $affinity "podAffinity" | default dict }}
{{- $preferred := get $podAffinity "preferredDuringSchedulingIgnoredDuringExecution" | default list }}
{{- $_ := set $podAffinity "preferredDuringSchedulingIgnoredDuringExecution" (append $preferred $term) }}
{{- $_ := set $affinity "podAffinity" $podAffinity }}
{{- $ownLabels := include "tandem.selectorLabels" . | fromYaml }}
{{- $spread = list (dict "maxSkew" 1 "topologyKey" "kubernetes.io/hostname" "whenUnsatisfiable" "ScheduleAnyway" "labelSelector" (dict "matchLabels" $ownLabels)) }}
{{- end }}
{{- include "tandem.scheduling" (dict "nodeSelector" $values.nodeSelector "tolerations" $values.tolerations "affinity" $affinity) }}
{{- with $spread }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
