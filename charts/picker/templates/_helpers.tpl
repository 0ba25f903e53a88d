{{/* The pool's name: the release name, as the reference chart does. */}}
{{- define "picker.poolName" -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The picker's Deployment, Service, ServiceAccount and ConfigMap name. */}}
{{- define "picker.name" -}}
{{- printf "%s-epp" (include "picker.poolName" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "picker.selectorLabels" -}}
app.kubernetes.io/name: picker
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "picker.labels" -}}
{{ include "picker.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "picker.image" -}}
{{- $image := .Values.inferenceExtension.image -}}
{{- printf "%s/%s:%s" $image.registry $image.repository (default .Chart.AppVersion $image.tag) -}}
{{- end -}}

{{/* The pool's API group (inference.networking.k8s.io or the legacy x-k8s.io group). */}}
{{- define "picker.poolGroup" -}}
{{- index (splitList "/" .Values.inferencePool.apiVersion) 0 -}}
{{- end -}}

{{/* label=value,... for --endpoint-selector. */}}
{{- define "picker.endpointSelector" -}}
{{- $pairs := list -}}
{{- range $key, $value := .Values.inferencePool.modelServers.matchLabels -}}
{{- $pairs = append $pairs (printf "%s=%s" $key $value) -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}

{{- define "picker.targetPortsCsv" -}}
{{- $ports := list -}}
{{- range .Values.inferencePool.targetPorts -}}
{{- $ports = append $ports (toString .number) -}}
{{- end -}}
{{- join "," $ports -}}
{{- end -}}

{{/* The EndpointPickerConfig used when pluginsConfigFile is default-plugins.yaml. */}}
{{- define "picker.defaultPlugins" -}}
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
{{- end -}}
