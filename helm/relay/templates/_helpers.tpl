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
{{- end -}}
