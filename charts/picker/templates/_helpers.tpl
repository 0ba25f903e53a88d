{{/* The pool's name: the release name, as the reference chart does. */}}
{{- define "picker.poolName" -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* "true" in standalone mode (no InferencePool: the picker selects the pods itself): picker's
inferencePool.standalone, or the reference standalone chart's endpointsServer without
createInferencePool, read as that chart reads it. */}}
{{- define "picker.standalone" -}}
{{- $servers := .Values.inferenceExtension.endpointsServer -}}
{{- if or .Values.inferencePool.standalone (and $servers (not $servers.createInferencePool)) }}true{{ end -}}
{{- end -}}

{{/* The picker's Deployment, Service, ServiceAccount and ConfigMap name. */}}
{{- define "picker.name" -}}
{{- printf "%s-epp" (include "picker.poolName" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The Deployment's selector: the reference chart's own, so that `helm upgrade` can swap a
reference release for picker in place (a Deployment's selector cannot change). */}}
{{- define "picker.selectorLabels" -}}
{{- if include "picker.standalone" . -}}
epp: {{ include "picker.name" . }}
{{- else -}}
inferencepool: {{ include "picker.name" . }}
{{- end -}}
{{- end -}}

{{/* The picker's pods: the selector, the reference's mode label and picker's own. */}}
{{- define "picker.podLabels" -}}
{{ include "picker.selectorLabels" . }}
inference.networking.k8s.io/igw-mode: {{ ternary "standalone" "inferencepool" (eq (include "picker.standalone" .) "true") }}
app.kubernetes.io/name: picker
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "picker.labels" -}}
app.kubernetes.io/name: picker
app.kubernetes.io/instance: {{ .Release.Name }}
{{ include "picker.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The image `make image` builds: the defaults of values.yaml, repeated here because a
reference EPP image in the values is replaced by it (tests/unit/test_image.py keeps the two and
the Makefile in agreement). */}}
{{- define "picker.defaultImage" -}}
{{- dict "registry" "ghcr.io" "repository" "picker-inference/picker" "tag" "" "pullPolicy" "IfNotPresent" | toJson -}}
{{- end -}}

{{/* True when the values name the reference EPP's image, which cannot run `picker serve`. */}}
{{- define "picker.isReferenceImage" -}}
{{- if hasSuffix "gateway-api-inference-extension/epp" .Values.inferenceExtension.image.repository }}true{{ end -}}
{{- end -}}

{{/* The image in use, as JSON: the values' image, or the default one in place of the reference's. */}}
{{- define "picker.imageValues" -}}
{{- if include "picker.isReferenceImage" . -}}
{{- include "picker.defaultImage" . -}}
{{- else -}}
{{- .Values.inferenceExtension.image | toJson -}}
{{- end -}}
{{- end -}}

{{- define "picker.image" -}}
{{- $image := include "picker.imageValues" . | fromJson -}}
{{- printf "%s/%s:%s" $image.registry $image.repository (default .Chart.AppVersion $image.tag) -}}
{{- end -}}

{{/* The pool's API group (inference.networking.k8s.io or the legacy x-k8s.io group). */}}
{{- define "picker.poolGroup" -}}
{{- index (splitList "/" .Values.inferencePool.apiVersion) 0 -}}
{{- end -}}

{{/* label=value,... for --endpoint-selector: in standalone mode endpointsServer.endpointSelector
(the reference standalone chart's) when set, else inferencePool.modelServers.matchLabels. */}}
{{- define "picker.endpointSelector" -}}
{{- $servers := .Values.inferenceExtension.endpointsServer | default dict -}}
{{- if and (include "picker.standalone" .) $servers.endpointSelector -}}
{{- $servers.endpointSelector -}}
{{- else -}}
{{- $pairs := list -}}
{{- range $key, $value := .Values.inferencePool.modelServers.matchLabels -}}
{{- $pairs = append $pairs (printf "%s=%s" $key $value) -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}
{{- end -}}

{{/* The pods' ports, comma-separated: endpointsServer.targetPorts in standalone mode when set (a
number or "8000,8001", as the reference standalone chart takes it), else inferencePool.targetPorts. */}}
{{- define "picker.targetPortsCsv" -}}
{{- $servers := .Values.inferenceExtension.endpointsServer | default dict -}}
{{- if and (include "picker.standalone" .) (not (kindIs "invalid" $servers.targetPorts)) -}}
{{- include "picker.flagValue" $servers.targetPorts -}}
{{- else -}}
{{- $ports := list -}}
{{- range .Values.inferencePool.targetPorts -}}
{{- $ports = append $ports (toString .number) -}}
{{- end -}}
{{- join "," $ports -}}
{{- end -}}
{{- end -}}

{{/* The engine (vllm, sglang, ...) and protocol (http, grpc) of the model servers: in standalone mode
endpointsServer's when set (the reference standalone chart reads them there), else inferencePool's. */}}
{{- define "picker.modelServerType" -}}
{{- $servers := .Values.inferenceExtension.endpointsServer | default dict -}}
{{- if and (include "picker.standalone" .) $servers.modelServerType -}}
{{- $servers.modelServerType -}}
{{- else -}}
{{- .Values.inferencePool.modelServerType | default "vllm" -}}
{{- end -}}
{{- end -}}

{{- define "picker.modelServerProtocol" -}}
{{- $servers := .Values.inferenceExtension.endpointsServer | default dict -}}
{{- if and (include "picker.standalone" .) $servers.modelServerProtocol -}}
{{- $servers.modelServerProtocol -}}
{{- else -}}
{{- .Values.inferencePool.modelServerProtocol | default "http" -}}
{{- end -}}
{{- end -}}

{{/* The metrics path for the default config: trtllm-serve serves /prometheus/metrics, so the
default /metrics means that path for it (the reference chart meant the same with a flag its own
config then overrode). */}}
{{- define "picker.metricsPath" -}}
{{- $path := .Values.inferenceExtension.metricsDataSource.path | default "/metrics" -}}
{{- if and (eq (include "picker.modelServerType" .) "trtllm-serve") (eq $path "/metrics") -}}
/prometheus/metrics
{{- else -}}
{{- $path -}}
{{- end -}}
{{- end -}}

{{/* The EndpointPickerConfig used when pluginsConfigFile is default-plugins.yaml: the reference
chart's default-plugins.yaml (v1.5.0), data layer, parser and latency-predictor plugins included
(the plugins only: picker predicts latency itself, without the reference's sidecars). */}}
{{- define "picker.defaultPlugins" -}}
{{- $source := .Values.inferenceExtension.metricsDataSource -}}
{{- $engine := include "picker.modelServerType" . -}}
{{- $parser := .Values.inferencePool.parser -}}
{{- if and (eq (lower $engine) "vllm") (eq (include "picker.modelServerProtocol" .) "grpc") -}}
{{- $parser = "vllmgrpc-parser" -}}
{{- end -}}
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: metrics-data-source
  parameters:
    scheme: {{ $source.scheme | default "http" | quote }}
    path: {{ include "picker.metricsPath" . | quote }}
    insecureSkipVerify: {{ ternary true $source.insecureSkipVerify (kindIs "invalid" $source.insecureSkipVerify) }}
- type: core-metrics-extractor
  {{- if ne $engine "vllm" }}
  parameters:
    defaultEngine: {{ $engine | quote }}
  {{- end }}
{{- with $parser }}
- type: {{ . }}
{{- end }}
{{- if .Values.inferenceExtension.latencyPredictor.enabled }}
- type: predicted-latency-producer
# Two-gate prefix cache affinity: strict (0.99) before the SLO tier filter, loose (0.80) after it.
- name: strict-affinity-filter
  type: prefix-cache-affinity-filter
  parameters:
    affinityThreshold: 0.99
- name: loose-affinity-filter
  type: prefix-cache-affinity-filter
  parameters:
    affinityThreshold: 0.80
- type: latency-scorer
- type: weighted-random-picker
- type: slo-headroom-tier-filter
- type: latency-slo-admitter
{{- end }}
schedulingProfiles:
- name: default
  plugins:
{{- if .Values.inferenceExtension.latencyPredictor.enabled }}
  - pluginRef: predicted-latency-producer
  - pluginRef: strict-affinity-filter
  - pluginRef: slo-headroom-tier-filter
  - pluginRef: loose-affinity-filter
  - pluginRef: latency-scorer
  - pluginRef: weighted-random-picker
{{- else }}
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
{{- end }}
{{- with $parser }}
parser:
  pluginRef: {{ . }}
{{- end }}
{{- end -}}

{{/* A flag value as text: whole numbers without an exponent (values from YAML are floats). */}}
{{- define "picker.flagValue" -}}
{{- if and (kindIs "float64" .) (eq . (float64 (int64 .))) -}}
{{- int64 . -}}
{{- else -}}
{{- . -}}
{{- end -}}
{{- end -}}

{{/* "true" when a Prometheus monitor is wanted (the reference's prometheus.enabled or picker's
earlier serviceMonitor.enabled). */}}
{{- define "picker.monitorEnabled" -}}
{{- $m := .Values.inferenceExtension.monitoring -}}
{{- if or $m.prometheus.enabled $m.serviceMonitor.enabled }}true{{ end -}}
{{- end -}}

{{/* Cluster-scoped objects carry the namespace in their name (releases in two namespaces). */}}
{{- define "picker.clusterName" -}}
{{- printf "%s-%s-epp" (include "picker.poolName" . | trunc 40) (.Release.Namespace | trunc 40) | trimSuffix "-" -}}
{{- end -}}

{{/* Values picker cannot honour fail the install with the reason, before anything is created. */}}
{{- define "picker.validate" -}}
{{- $ie := .Values.inferenceExtension -}}
{{- $pool := .Values.inferencePool -}}
{{- if and $pool.targetPortNumber (ne (int $pool.targetPortNumber) (int (index $pool.targetPorts 0).number)) -}}
{{- fail (printf "inferencePool.targetPortNumber (%d, the legacy single port) differs from targetPorts[0] (%d): set targetPorts only" (int $pool.targetPortNumber) (int (index $pool.targetPorts 0).number)) -}}
{{- end -}}
{{- if include "picker.shippedEnvoy" . -}}
{{- if or (not $ie.secureServing) (ne (int $ie.extProcPort) 9002) -}}
{{- fail "inferenceExtension.sidecar: the shipped Envoy config reaches the picker at 127.0.0.1:9002 over TLS: keep extProcPort 9002 and secureServing true, or give the sidecar's name, image and configMap" -}}
{{- end -}}
{{- else if and $ie.sidecar.enabled (or (not $ie.sidecar.name) (not $ie.sidecar.image)) -}}
{{- fail "inferenceExtension.sidecar: name and image are required when enabled" -}}
{{- end -}}
{{- end -}}

{{/* "true" when the sidecar is enabled with neither name nor image: the pod then runs Envoy with
the project's shipped config (envoy/gateway.yaml, which manifests/envoy/gateway.yaml links to),
clients on port 8081, routed by the picker over localhost. */}}
{{- define "picker.shippedEnvoy" -}}
{{- $sidecar := .Values.inferenceExtension.sidecar -}}
{{- if and $sidecar.enabled (not $sidecar.name) (not $sidecar.image) }}true{{ end -}}
{{- end -}}

{{/* The shipped Envoy sidecar's settings; sidecar values given beside `enabled` override them. The
image is the Envoy release the tests run the config with (tests/e2e/test_chart_standalone.py). */}}
{{- define "picker.shippedEnvoySidecar" -}}
{{- $files := printf "%s-envoy" (include "picker.name" .) | trunc 63 | trimSuffix "-" -}}
name: envoy
image: docker.io/envoyproxy/envoy:distroless-v1.40.0
command: envoy
args: ["--log-level", "warn", "--drain-strategy", "immediate", "-c", "/etc/envoy/envoy.yaml"]
ports:
- name: http
  containerPort: 8081
readinessProbe:
  tcpSocket:
    port: 8081
  periodSeconds: 5
resources:
  requests:
    cpu: 100m
    memory: 128Mi
volumeMounts:
- name: envoy-config
  mountPath: /etc/envoy
  readOnly: true
volumes:
- name: envoy-config
  configMap:
    name: {{ $files }}
configMap:
  name: {{ $files }}
  data:
    envoy.yaml: {{ .Files.Get "envoy/gateway.yaml" | quote }}
{{- end -}}

{{/* The sidecar in use, as JSON: the values' own, or the shipped Envoy under them. */}}
{{- define "picker.sidecar" -}}
{{- $sidecar := .Values.inferenceExtension.sidecar -}}
{{- if include "picker.shippedEnvoy" . -}}
{{- mergeOverwrite (include "picker.shippedEnvoySidecar" . | fromYaml) (deepCopy $sidecar) | toJson -}}
{{- else -}}
{{- $sidecar | toJson -}}
{{- end -}}
{{- end -}}

{{/* picker's built-in configs (picker/config/builtin/*.yaml, in the image), by file name;
tests/e2e/test_chart.py checks this list against that directory. */}}
{{- define "picker.builtinConfigs" -}}
overhead-flowcontrol-off.yaml overhead-flowcontrol-on.yaml picker-best.yaml picker-conversation.yaml picker-e2e.yaml picker-flowcontrol-rr.yaml picker-flowcontrol-strict.yaml picker-pd-predicted.yaml picker-pd.yaml picker-precise.yaml reference-approx.yaml
{{- end -}}

{{/* "true" when pluginsConfigFile names a built-in config: neither default-plugins.yaml nor a
key of pluginsCustomConfig (which win over a built-in of the same name). Fails for a name that
is none of the three. */}}
{{- define "picker.builtinConfig" -}}
{{- $file := .Values.inferenceExtension.pluginsConfigFile -}}
{{- if and (ne $file "default-plugins.yaml") (not (hasKey .Values.inferenceExtension.pluginsCustomConfig $file)) -}}
{{- $builtin := splitList " " (include "picker.builtinConfigs" .) -}}
{{- if has $file $builtin -}}
true
{{- else -}}
{{- fail (printf "inferenceExtension.pluginsConfigFile %q is neither default-plugins.yaml, a key of inferenceExtension.pluginsCustomConfig, nor a built-in config (%s)" $file (join ", " $builtin)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
