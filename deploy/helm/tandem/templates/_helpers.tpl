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
Where Redis is, without credentials: the bundled StatefulSet's Service, or redis.url.
*/}}
{{- define "tandem.redisAddress" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s:%d/0" (include "tandem.componentName" (dict "root" . "component" "redis")) (int .Values.redis.port) -}}
{{- else -}}
{{- required "redis.url is required when redis.enabled is false (e.g. redis://my-redis:6379/0)" .Values.redis.url -}}
{{- end -}}
{{- end -}}

{{/*
The Secret holding the Redis password (key redis-password), or "" when clients send none:
the bundled Redis gets a generated one unless auth.redisPassword.existingSecret is set; an
external Redis gets one only from existingSecret.
*/}}
{{- define "tandem.redisPasswordSecret" -}}
{{- $auth := .Values.auth.redisPassword -}}
{{- if $auth.enabled -}}
{{- if $auth.existingSecret -}}
{{- $auth.existingSecret -}}
{{- else if .Values.redis.enabled -}}
{{- include "tandem.componentName" (dict "root" . "component" "redis-password") -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The Redis URL every process gets (TANDEM_REDIS_URL): tandem.redisAddress with the password,
when there is one, as `$(REDIS_PASSWORD)`, which the kubelet fills in from the REDIS_PASSWORD
env entry (tandem.redisEnv) so that the manifest never holds it.
*/}}
{{- define "tandem.redisUrl" -}}
{{- $address := include "tandem.redisAddress" . -}}
{{- if include "tandem.redisPasswordSecret" . -}}
{{- $parts := splitn "://" 2 $address -}}
{{- if contains "@" $parts._1 -}}
{{- fail "redis.url holds credentials and auth.redisPassword.existingSecret is set: drop them from the URL" -}}
{{- end -}}
{{- printf "%s://:$(REDIS_PASSWORD)@%s" $parts._0 $parts._1 -}}
{{- else -}}
{{- $address -}}
{{- end -}}
{{- end -}}

{{/* The env entries of a Tandem container for Redis: REDIS_PASSWORD (from its Secret, when
there is one) first, then TANDEM_REDIS_URL, which refers to it. */}}
{{- define "tandem.redisEnv" -}}
{{- with include "tandem.redisPasswordSecret" . }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: redis-password
{{- end }}
- name: TANDEM_REDIS_URL
  value: {{ include "tandem.redisUrl" . | quote }}
{{- end -}}

{{/* TANDEM_HOST of a Tandem container: the pod's IP (downward API) with listenAddress
"podIP", else listenAddress as given. */}}
{{- define "tandem.hostEnv" -}}
- name: TANDEM_HOST
{{- if eq .Values.listenAddress "podIP" }}
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- else }}
  value: {{ .Values.listenAddress | quote }}
{{- end }}
{{- end -}}

{{/*
The credential Secrets a component mounts, as a list of dicts: volume (its name, also the
directory /etc/tandem/<volume>), secret (the Secret's name), keys (Secret key -> file name)
and env (TANDEM_* variable -> Secret key of the file it names). Call with
(dict "root" $ "component" "router"); the result is YAML (fromYamlArray it).
*/}}
{{- define "tandem.authSecrets" -}}
{{- $root := .root }}
{{- $auth := $root.Values.auth }}
{{- $mounts := list }}
{{- if and (eq .component "router") $auth.apiKeys.enabled }}
{{- $name := $auth.apiKeys.existingSecret | default (include "tandem.componentName" (dict "root" $root "component" "api-keys")) }}
{{- $mounts = append $mounts (dict "volume" "api-keys" "secret" $name "keys" (list "api-keys") "env" (dict "TANDEM_API_KEYS_FILE" "api-keys")) }}
{{- end }}
{{- if and (eq .component "router") $auth.tls.secretName }}
{{- $mounts = append $mounts (dict "volume" "tls" "secret" $auth.tls.secretName "keys" (list "tls.crt" "tls.key") "env" (dict "TANDEM_TLS_CERT_FILE" "tls.crt" "TANDEM_TLS_KEY_FILE" "tls.key")) }}
{{- end }}
{{- if $auth.clusterSecret.enabled }}
{{- $name := $auth.clusterSecret.existingSecret | default (include "tandem.componentName" (dict "root" $root "component" "cluster-secret")) }}
{{- $mounts = append $mounts (dict "volume" "cluster-secret" "secret" $name "keys" (list "cluster-secret") "env" (dict "TANDEM_CLUSTER_SECRET_FILE" "cluster-secret")) }}
{{- end }}
{{- if $auth.internalTls.secretName }}
{{- $mounts = append $mounts (dict "volume" "internal-tls" "secret" $auth.internalTls.secretName "keys" (list "tls.crt" "tls.key" "ca.crt") "env" (dict "TANDEM_INTERNAL_TLS_CERT_FILE" "tls.crt" "TANDEM_INTERNAL_TLS_KEY_FILE" "tls.key" "TANDEM_INTERNAL_CA_FILE" "ca.crt")) }}
{{- end }}
{{- if and (eq .component "controller") $auth.adminKeys.enabled }}
{{- $name := $auth.adminKeys.existingSecret | default (include "tandem.componentName" (dict "root" $root "component" "admin-keys")) }}
{{- $mounts = append $mounts (dict "volume" "admin-keys" "secret" $name "keys" (list "admin-keys") "env" (dict "TANDEM_ADMIN_KEYS_FILE" "admin-keys")) }}
{{- end }}
{{- toYaml $mounts }}
{{- end -}}

{{/* The credential env of a component: every *_file field the chart owns, naming the
mounted file, or "" (off). Same arguments as tandem.authSecrets. */}}
{{- define "tandem.authEnv" -}}
{{- $files := dict "TANDEM_CLUSTER_SECRET_FILE" "" "TANDEM_INTERNAL_TLS_CERT_FILE" "" "TANDEM_INTERNAL_TLS_KEY_FILE" "" "TANDEM_INTERNAL_CA_FILE" "" }}
{{- if eq .component "router" }}
{{- $_ := merge $files (dict "TANDEM_API_KEYS_FILE" "" "TANDEM_TLS_CERT_FILE" "" "TANDEM_TLS_KEY_FILE" "") }}
{{- end }}
{{- if eq .component "controller" }}
{{- $_ := set $files "TANDEM_ADMIN_KEYS_FILE" "" }}
{{- end }}
{{- range $mount := include "tandem.authSecrets" . | fromYamlArray }}
{{- range $env, $key := $mount.env }}
{{- $_ := set $files $env (printf "/etc/tandem/%s/%s" $mount.volume $key) }}
{{- end }}
{{- end }}
{{- range $env, $path := $files }}
- name: {{ $env }}
  value: {{ $path | quote }}
{{- end }}
{{- end -}}

{{/* Whether a component's gRPC port speaks TLS ("true" or ""): the router's with auth.tls,
the others' with auth.internalTls. Call with (dict "root" $ "component" "router"). */}}
{{- define "tandem.tlsPort" -}}
{{- if eq .component "router" -}}
{{- if .root.Values.auth.tls.secretName }}true{{ end -}}
{{- else if .root.Values.auth.internalTls.secretName -}}
true
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
component's config dataclass (services/common/runtime/flags.py). Keys come sorted.
*/}}
{{- define "tandem.configEnv" -}}
{{- range $key, $value := . }}
- name: TANDEM_{{ upper $key }}
  value: {{ include "tandem.envValue" $value | quote }}
{{- end }}
{{- end -}}

{{/*
A gRPC health probe (grpc.health.v1.Health/Check, service ""). Kubernetes >= 1.24 checks it
natively; older clusters exec tandem.services.common.rpc.healthcheck in the container, which dials
127.0.0.1 unless told the pod IP the server listens on (listenAddress podIP: through a
shell, as exec probes expand no downward-API variables). A TLS port ("tls" true) gets a TCP
probe: neither the kubelet's gRPC probe nor the healthcheck speaks TLS.
Call with (dict "root" $ "port" 50051 "tls" "" "probe" .Values.probes.readiness).
*/}}
{{- define "tandem.grpcProbe" -}}
{{- $timeout := max 1 (sub (int .probe.timeoutSeconds) 1) }}
{{- if .tls }}
tcpSocket:
  port: {{ .port }}
{{- else if semverCompare ">=1.24-0" .root.Capabilities.KubeVersion.Version }}
grpc:
  port: {{ .port }}
{{- else if eq .root.Values.listenAddress "podIP" }}
exec:
  command:
    - sh
    - -c
    - {{ printf "exec %s -m tandem.services.common.rpc.healthcheck --port %d --timeout-s %d --host \"$TANDEM_HOST\"" .root.Values.python (int .port) $timeout | quote }}
{{- else }}
exec:
  command:
    - {{ .root.Values.python }}
    - -m
    - tandem.services.common.rpc.healthcheck
    - --port
    - {{ .port | quote }}
    - --timeout-s
    - {{ $timeout | quote }}
{{- end }}
{{ toYaml .probe }}
{{- end -}}

{{/* readiness, liveness and startup probes of a gRPC container; call with (dict "root" $
"component" "router" "port" 50051 "startup" .startupProbe): "startup" are the component's own
startupProbe keys, which override probes.startup (workers load weights and warm up before
they report SERVING: minutes on a GPU). */}}
{{- define "tandem.grpcProbes" -}}
{{- $startup := merge (deepCopy (.startup | default dict)) .root.Values.probes.startup }}
{{- $tls := include "tandem.tlsPort" . }}
readinessProbe:
  {{- include "tandem.grpcProbe" (dict "root" .root "port" .port "tls" $tls "probe" .root.Values.probes.readiness) | trim | nindent 2 }}
livenessProbe:
  {{- include "tandem.grpcProbe" (dict "root" .root "port" .port "tls" $tls "probe" .root.Values.probes.liveness) | trim | nindent 2 }}
startupProbe:
  {{- include "tandem.grpcProbe" (dict "root" .root "port" .port "tls" $tls "probe" $startup) | trim | nindent 2 }}
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
transfer.shmSizeLimit), the component's credential Secrets (tandem.authSecrets, with
"component"), then the component's extraVolumes. Empty when there are none.
Call with (dict "root" $ "component" "router" "model" true "shm" false "extra" .extraVolumes).
*/}}
{{- define "tandem.volumes" -}}
{{- $values := .root.Values }}
{{- $secrets := list }}
{{- if .component }}
{{- $secrets = include "tandem.authSecrets" . | fromYamlArray }}
{{- end }}
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
{{- range $secrets }}
- name: {{ .volume }}
  secret:
    secretName: {{ .secret }}
    # 0444: the image's non-root user reads it without an fsGroup (read-only mount).
    defaultMode: 0444
    items:
      {{- range .keys }}
      - key: {{ . }}
        path: {{ . }}
      {{- end }}
{{- end }}
{{- with .extra }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The main container's volumeMounts matching tandem.volumes (same arguments, "extra":
the component's extraVolumeMounts). */}}
{{- define "tandem.volumeMounts" -}}
{{- $values := .root.Values }}
{{- $secrets := list }}
{{- if .component }}
{{- $secrets = include "tandem.authSecrets" . | fromYamlArray }}
{{- end }}
{{- if and .model (ne (include "tandem.modelSource" .root) "baked") }}
- name: model
  mountPath: {{ $values.model.mountPath }}
  readOnly: true
{{- end }}
{{- if and .shm $values.transfer.shmSizeLimit }}
- name: dshm
  mountPath: /dev/shm
{{- end }}
{{- range $secrets }}
- name: {{ .volume }}
  mountPath: /etc/tandem/{{ .volume }}
  readOnly: true
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
{{- /* speculative: draft. The prefill worker prefills the draft and hands its KV over: both
roles load the same draft model, from the model's volume (or the image, model.baked). */ -}}
{{- $prefillDraft := (.Values.prefill.config | default dict).draft_model | default "" -}}
{{- $decodeDraft := (.Values.decode.config | default dict).draft_model | default "" -}}
{{- if ne $prefillDraft $decodeDraft -}}
{{- fail (printf "prefill.config.draft_model (%q) and decode.config.draft_model (%q) must be the same (with speculative: draft in both): the prefill worker prefills the draft model and hands its KV over" $prefillDraft $decodeDraft) -}}
{{- end -}}
{{- if and $decodeDraft (not .Values.model.baked) (not .Values.model.volume) -}}
{{- fail "draft_model needs the model on a volume (model.volume) or in the image (model.baked): the generated demo model's emptyDir holds no draft model" -}}
{{- end -}}
{{- if and $decodeDraft (not .Values.model.baked) (not (hasPrefix (printf "%s/" (trimSuffix "/" .Values.model.mountPath)) $decodeDraft)) -}}
{{- fail (printf "draft_model (%s) must lie under model.mountPath (%s): the draft model is read from the model's volume" $decodeDraft .Values.model.mountPath) -}}
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
