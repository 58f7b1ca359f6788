{{- define "relay.labels" -}}
app.kubernetes.io/name: relay
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}

{{- define "relay.databaseEnv" -}}
- name: RELAY_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.database.secretName }}
      key: {{ .Values.database.secretKey }}
- name: RELAY_LOG_FORMAT
  value: {{ .Values.logFormat | quote }}
{{- if .Values.tls.caConfigMap }}
- name: RELAY_TLS_CA_FILE
  value: /etc/relay/tls/{{ .Values.tls.caKey }}
{{- end }}
{{- end -}}

{{/* The operator's CA bundle (values `tls`), mounted where RELAY_TLS_CA_FILE points. */}}
{{- define "relay.caMount" -}}
{{- if .Values.tls.caConfigMap }}
volumeMounts:
  - { name: relay-ca, mountPath: /etc/relay/tls, readOnly: true }
{{- end }}
{{- end -}}

{{- define "relay.caVolume" -}}
{{- if .Values.tls.caConfigMap }}
volumes:
  - name: relay-ca
    configMap: { name: {{ .Values.tls.caConfigMap }} }
{{- end }}
{{- end -}}
