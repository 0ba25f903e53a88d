{{/* The image `make image` builds (charts/picker's default), in place of the reference bbr's,
which cannot run `picker bbr`. */}}
{{- define "picker-bbr.image" -}}
{{- $image := .Values.bbr.image -}}
{{- if hasSuffix "gateway-api-inference-extension/bbr" $image.repository -}}
{{- $image = dict "registry" "ghcr.io" "repository" "picker-inference/picker" "tag" "" "pullPolicy" $image.pullPolicy -}}
{{- end -}}
{{- printf "%s/%s:%s" $image.registry $image.repository (default .Chart.AppVersion $image.tag) -}}
{{- end -}}

{{/* The ServiceAccount the router runs as (the reference chart's name). */}}
{{- define "picker-bbr.serviceAccount" -}}
{{- printf "%s-%s" .Values.bbr.name .Release.Name -}}
{{- end -}}
