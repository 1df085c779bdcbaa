{{- define "kvtier.name" -}}kvtier{{- end -}}
{{- define "kvtier.fullname" -}}{{ printf "%s-kvtier" .Release.Name | trunc 63 | trimSuffix "-" }}{{- end -}}
{{- define "kvtier.labels" -}}
app.kubernetes.io/name: kvtier
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}
{{- define "kvtier.selectorLabels" -}}
app.kubernetes.io/name: kvtier
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
{{- define "kvtier.image" -}}{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}{{- end -}}
{{- define "kvtier.offloadImage" -}}
{{- /* sidecarImage: offloadImage's name before 0.2 (deprecated), overriding it when set */ -}}
{{- $image := merge (dict) (.Values.sidecarImage | default dict) .Values.offloadImage -}}
{{ $image.repository }}:{{ $image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- define "kvtier.webhookService" -}}{{ include "kvtier.fullname" . }}-webhook{{- end -}}
{{- define "kvtier.certSecret" -}}{{ include "kvtier.fullname" . }}-webhook-tls{{- end -}}
{{- /* The matchCondition that picks the operator's own requests (operator-policy.yaml) */ -}}
{{- define "kvtier.operatorIdentity" -}}
request.userInfo.username == 'system:serviceaccount:{{ .Release.Namespace }}:{{ include "kvtier.fullname" . }}'
{{- end }}
