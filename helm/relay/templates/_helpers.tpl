{{/*
Names: "<fullname>-<tier>". Cut to 45 characters so that the longest name made from it
("<fullname>-publisher-metrics") stays within Kubernetes' 63.
*/}}
{{- define "relay.fullname" -}}
{{- default .Release.Name .Values.fullnameOverride | trunc 45 | trimSuffix "-" -}}
{{- end -}}

{{- define "relay.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "relay.labels" -}}
helm.sh/chart: {{ include "relay.chart" . }}
app.kubernetes.io/name: relay
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: relay
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
A tier's pod selector, as a dict (root, tier). Unchanged since the chart's first version: a
Deployment's selector cannot change on upgrade.
*/}}
{{- define "relay.selectorLabels" -}}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .tier }}
{{- end -}}

{{- define "relay.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "relay.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "relay.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion | toString) -}}
{{- end -}}
{{- end -}}

{{/*
An env value as the relay reads it. Helm reads numbers in values as floats: 1048576 would print
as "1.048576e+06", so whole numbers are printed as integers.
*/}}
{{- define "relay.envValue" -}}
{{- if and (kindIs "float64" .) (eq . (floor .)) -}}
{{- int64 . | toString -}}
{{- else -}}
{{- toString . -}}
{{- end -}}
{{- end -}}

{{/*
A container's env, as a dict (root, tier, values: the tier's values; tier "migrate" for the
migration job). In order: the Secrets' settings, the plain settings (the chart's defaults under
the global `env` under the tier's `env`) and the `extraEnv` lists (the tier's over the global
one). Each name appears once: a later source replaces an earlier one. The settings the chart
owns (listen addresses, the mounted files) must not be set by hand: the ports, probes and mounts
follow them.
*/}}
{{- define "relay.env" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
{{- $tier := .tier -}}
{{- $t := .values -}}
{{- $owned := dict -}}
{{- if eq $tier "ingest" -}}
{{- $_ := set $owned "RELAY_INGEST_LISTEN" (printf "0.0.0.0:%v" (include "relay.envValue" $t.port)) -}}
{{- $_ := set $owned "RELAY_METRICS_LISTEN" (printf "0.0.0.0:%v" (include "relay.envValue" $t.metricsPort)) -}}
{{- else if eq $tier "api" -}}
{{- $_ := set $owned "RELAY_API_LISTEN" (printf "0.0.0.0:%v" (include "relay.envValue" $t.port)) -}}
{{- $_ := set $owned "RELAY_API_METRICS_LISTEN" (printf "0.0.0.0:%v" (include "relay.envValue" $t.metricsPort)) -}}
{{- $_ := set $owned "RELAY_API_JWT_SECRET_FILE" "/etc/relay/jwt/key" -}}
{{- if $v.jwt.previousSecretKey -}}
{{- if not $v.jwt.rotationStartedAt -}}
{{- fail "jwt.previousSecretKey is set: set jwt.rotationStartedAt too (when the current key began signing, RFC 3339 or Unix seconds); the relay refuses a previous key without it" -}}
{{- end -}}
{{- $_ := set $owned "RELAY_API_JWT_PREVIOUS_SECRET_FILE" "/etc/relay/jwt/previous-key" -}}
{{- $_ := set $owned "RELAY_API_JWT_ROTATION_STARTED_AT" (include "relay.envValue" $v.jwt.rotationStartedAt) -}}
{{- $_ := set $owned "RELAY_API_JWT_PREVIOUS_KEY_OVERLAP_S" (include "relay.envValue" $v.jwt.previousKeyOverlapSeconds) -}}
{{- end -}}
{{- else if ne $tier "migrate" -}}
{{- $_ := set $owned (printf "RELAY_%s_METRICS_LISTEN" (upper $tier)) (printf "0.0.0.0:%v" (include "relay.envValue" $t.metricsPort)) -}}
{{- end -}}
{{- if $v.tls.caConfigMap -}}
{{- $_ := set $owned "RELAY_TLS_CA_FILE" (printf "/etc/relay/tls/%s" $v.tls.caKey) -}}
{{- end -}}
{{- /* Every tier and the migration open the stored secrets with the mounted key file. */ -}}
{{- $_ := set $owned "RELAY_SEAL_KEYS_FILE" "/etc/relay/seal/keys" -}}
{{- /* Never beside RELAY_API_JWT_SECRET_FILE or RELAY_SEAL_KEYS_FILE (the relay refuses both). */ -}}
{{- $refused := dict "RELAY_SEAL_KEYS" "sealKeys.secretName and sealKeys.secretKey" -}}
{{- if eq $tier "api" -}}
{{- $_ := set $refused "RELAY_API_JWT_SECRET" "jwt.secretName and jwt.secretKey" -}}
{{- end -}}
{{- $globalExtra := $v.extraEnv | default list -}}
{{- $tierExtra := $t.extraEnv | default list -}}
{{- $tierExtraNames := dict -}}
{{- range $tierExtra -}}
{{- $_ := set $tierExtraNames .name true -}}
{{- end -}}
{{- $extra := list -}}
{{- range $globalExtra -}}
{{- if not (hasKey $tierExtraNames .name) -}}
{{- $extra = append $extra . -}}
{{- end -}}
{{- end -}}
{{- $extra = concat $extra $tierExtra -}}
{{- $user := merge (dict) ($t.env | default dict) ($v.env | default dict) -}}
{{- $taken := dict -}}
{{- range $extra -}}
{{- $_ := set $taken .name true -}}
{{- end -}}
{{- range $name := concat (keys $user) (keys $taken) -}}
{{- if hasKey $owned $name -}}
{{- fail (printf "%s: %s is set by the chart (from the ports and mounts in values); do not set it in env or extraEnv" $tier $name) -}}
{{- end -}}
{{- if hasKey $refused $name -}}
{{- fail (printf "%s: %s cannot be set: the key comes from %s" $tier $name (get $refused $name)) -}}
{{- end -}}
{{- end -}}
{{- $defaults := dict "RELAY_LOG_FORMAT" $v.logFormat -}}
{{- $secrets := dict "RELAY_DATABASE_URL" (dict "name" $v.database.secretName "key" $v.database.secretKey) -}}
{{- if ne $tier "migrate" -}}
{{- if $v.redis.secretName -}}
{{- $_ := set $secrets "RELAY_REDIS_URL" (dict "name" $v.redis.secretName "key" $v.redis.secretKey) -}}
{{- else -}}
{{- $_ := set $defaults "RELAY_REDIS_URL" $v.redis.url -}}
{{- end -}}
{{- if $v.redis.keyPrefix -}}
{{- $_ := set $defaults "RELAY_REDIS_KEY_PREFIX" $v.redis.keyPrefix -}}
{{- end -}}
{{- /* Every tier reads the defaults: the front tier applies one, the control plane shows both. */ -}}
{{- $_ := set $defaults "RELAY_QUOTA_MAX_ENDPOINTS" $v.quotas.maxEndpoints -}}
{{- $_ := set $defaults "RELAY_QUOTA_MESSAGES_PER_SECOND" $v.quotas.messagesPerSecond -}}
{{- $_ := set $defaults "RELAY_BODY_BYTES_IN_FLIGHT" $v.bodies.bytesInFlight -}}
{{- $_ := set $defaults "RELAY_BODY_BYTES_PER_CLIENT" $v.bodies.bytesPerClient -}}
{{- if $v.trustedProxies -}}
{{- $_ := set $defaults "RELAY_TRUSTED_PROXIES" (join "," $v.trustedProxies) -}}
{{- end -}}
{{- if eq $tier "ingest" -}}
{{- $_ := set $defaults "RELAY_INGEST_CLIENT_ADDRESS" $t.clientAddress -}}
{{- else if eq $tier "api" -}}
{{- $_ := set $defaults "RELAY_API_CLIENT_ADDRESS" $t.clientAddress -}}
{{- end -}}
{{- end -}}
{{- if or (eq $tier "publisher") (eq $tier "api") -}}
{{- $_ := set $secrets "RELAY_AMQP_URL" (dict "name" $v.amqp.secretName "key" $v.amqp.secretKey) -}}
{{- end -}}
{{- $plain := merge (dict) $owned $user $defaults -}}
{{- range $name, $ref := $secrets }}
{{- if not (or (hasKey $plain $name) (hasKey $taken $name)) }}
- name: {{ $name }}
  valueFrom:
    secretKeyRef:
      name: {{ $ref.name | quote }}
      key: {{ $ref.key | quote }}
{{- end }}
{{- end }}
{{- range $name, $value := $plain }}
{{- if not (hasKey $taken $name) }}
- name: {{ $name }}
  value: {{ include "relay.envValue" $value | quote }}
{{- end }}
{{- end }}
{{- with $extra }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* A container's envFrom (root, values), the global list then the tier's. */}}
{{- define "relay.envFrom" -}}
{{- with concat (.root.Values.envFrom | default list) (.values.envFrom | default list) }}
envFrom:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* A container's mounts (root, tier). */}}
{{- define "relay.volumeMounts" -}}
{{- $v := .root.Values -}}
{{- $mounts := list -}}
{{- if $v.tls.caConfigMap -}}
{{- $mounts = append $mounts (dict "name" "relay-ca" "mountPath" "/etc/relay/tls" "readOnly" true) -}}
{{- end -}}
{{- $mounts = append $mounts (dict "name" "relay-seal-keys" "mountPath" "/etc/relay/seal" "readOnly" true) -}}
{{- if eq .tier "api" -}}
{{- $mounts = append $mounts (dict "name" "relay-jwt" "mountPath" "/etc/relay/jwt" "readOnly" true) -}}
{{- end -}}
{{- $mounts = concat $mounts ($v.extraVolumeMounts | default list) -}}
{{- with $mounts }}
volumeMounts:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* A pod's volumes (root, tier). */}}
{{- define "relay.volumes" -}}
{{- $v := .root.Values -}}
{{- $volumes := list -}}
{{- if $v.tls.caConfigMap -}}
{{- $volumes = append $volumes (dict "name" "relay-ca" "configMap" (dict "name" $v.tls.caConfigMap "items" (list (dict "key" $v.tls.caKey "path" $v.tls.caKey)))) -}}
{{- end -}}
{{- /* Every pod: the keys that seal stored secrets, 0440 for the relay's group (fsGroup). */ -}}
{{- $volumes = append $volumes (dict "name" "relay-seal-keys" "secret" (dict "secretName" $v.sealKeys.secretName "defaultMode" 288 "items" (list (dict "key" $v.sealKeys.secretKey "path" "keys")))) -}}
{{- if eq .tier "api" -}}
{{- $items := list (dict "key" $v.jwt.secretKey "path" "key") -}}
{{- if $v.jwt.previousSecretKey -}}
{{- $items = append $items (dict "key" $v.jwt.previousSecretKey "path" "previous-key") -}}
{{- end -}}
{{- /* 0440: the relay's group (fsGroup) reads it. */ -}}
{{- $volumes = append $volumes (dict "name" "relay-jwt" "secret" (dict "secretName" $v.jwt.secretName "defaultMode" 288 "items" $items)) -}}
{{- end -}}
{{- $volumes = concat $volumes ($v.extraVolumes | default list) -}}
{{- with $volumes }}
volumes:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
A pod's scheduling (root, tier, values): the tier's non-empty setting, else the global one. A
topology spread constraint without a labelSelector gets the tier's pod selector.
*/}}
{{- define "relay.scheduling" -}}
{{- $v := .root.Values -}}
{{- $t := .values -}}
{{- with $t.nodeSelector | default $v.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $t.tolerations | default $v.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $t.affinity | default $v.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $t.priorityClassName | default $v.priorityClassName }}
priorityClassName: {{ . | quote }}
{{- end }}
{{- if ne .tier "migrate" }}
{{- $selector := include "relay.selectorLabels" . | fromYaml -}}
{{- $constraints := list -}}
{{- range ($t.topologySpreadConstraints | default $v.topologySpreadConstraints) -}}
{{- $c := deepCopy . -}}
{{- if not $c.labelSelector -}}
{{- $_ := set $c "labelSelector" (dict "matchLabels" $selector) -}}
{{- end -}}
{{- $constraints = append $constraints $c -}}
{{- end -}}
{{- with $constraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
{{- end -}}

{{/* A pod's annotations and labels (root, values): the global ones, then the tier's. */}}
{{- define "relay.podAnnotations" -}}
{{- $a := merge (dict) (.values.podAnnotations | default dict) (.root.Values.podAnnotations | default dict) -}}
{{- with .metricsPort -}}
{{- if $.root.Values.metrics.podAnnotations -}}
{{- $a = merge (dict) $a (dict "prometheus.io/scrape" "true" "prometheus.io/port" (include "relay.envValue" .) "prometheus.io/path" "/metrics") -}}
{{- end -}}
{{- end -}}
{{- with $a }}
{{- toYaml . }}
{{- end }}
{{- end -}}

{{- define "relay.podLabels" -}}
{{- $l := merge (dict) (.values.podLabels | default dict) (.root.Values.podLabels | default dict) -}}
{{- with $l }}
{{- toYaml . }}
{{- end }}
{{- end -}}

{{/* A container's probes (root, values), on its metrics port. */}}
{{- define "relay.probes" -}}
{{- $p := mergeOverwrite (deepCopy .root.Values.probes) (deepCopy (.values.probes | default dict)) -}}
startupProbe:
  httpGet: { path: /healthz, port: metrics }
  {{- toYaml $p.startup | nindent 2 }}
livenessProbe:
  httpGet: { path: /healthz, port: metrics }
  {{- toYaml $p.liveness | nindent 2 }}
readinessProbe:
  httpGet: { path: /readyz, port: metrics }
  {{- toYaml $p.readiness | nindent 2 }}
{{- end -}}

{{/* The tiers the chart deploys, in order. */}}
{{- define "relay.tiers" -}}
{{- $tiers := list -}}
{{- range $tier := list "ingest" "sequencer" "publisher" "api" -}}
{{- if (index $.Values $tier).enabled -}}
{{- $tiers = append $tiers $tier -}}
{{- end -}}
{{- end -}}
{{- toJson $tiers -}}
{{- end -}}

{{/* A PodDisruptionBudget's minAvailable or maxUnavailable: a count or a percentage. */}}
{{- define "relay.pdbValue" -}}
{{- if kindIs "string" . -}}
{{- . | quote -}}
{{- else -}}
{{- int64 . -}}
{{- end -}}
{{- end -}}
