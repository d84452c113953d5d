{{/* The domain, checked: a DNS subdomain (what the plugin's config accepts). */}}
{{- define "gpu-share.domain" -}}
{{- $domain := .Values.domain | toString -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$" $domain) -}}
{{- fail (printf "domain: must be a DNS subdomain such as acme.io, got %q" $domain) -}}
{{- end -}}
{{- $domain -}}
{{- end -}}

{{/* The config file's text: .Values.config, else the chart's default. */}}
{{- define "gpu-share.config" -}}
{{- .Values.config | default (.Files.Get "files/config.yaml") -}}
{{- end -}}

{{/* The config parsed (for the settings the pods follow: kill policy, CDI, MPS pools). */}}
{{- define "gpu-share.configData" -}}
{{- $config := include "gpu-share.config" . | fromYaml -}}
{{- if hasKey $config "Error" -}}
{{- fail (printf "config: is not valid YAML: %s" $config.Error) -}}
{{- end -}}
{{- toJson $config -}}
{{- end -}}

{{/* The `extenders` entries of a KubeSchedulerConfiguration calling the extender (both ways of docs/scheduler.md):
the share entry, and the every-pod entry (DRA claims, CPU-only pods); weight 20 as measured there. */}}
{{- define "gpu-share.extenderCall" -}}
{{- $domain := include "gpu-share.domain" . -}}
- urlPrefix: https://gpu-share-extender.{{ .Release.Namespace }}.svc:{{ .Values.extender.port }}
  filterVerb: filter
  prioritizeVerb: prioritize
  weight: 20
  httpTimeout: 5s
  nodeCacheCapable: true
  ignorable: false
  enableHTTPS: true
  tlsConfig:
    serverName: gpu-share-extender.{{ .Release.Namespace }}.svc
    certFile: /etc/gpu-share-scheduler-tls/tls.crt
    keyFile: /etc/gpu-share-scheduler-tls/tls.key
    caFile: /etc/gpu-share-scheduler-tls/ca.crt
  managedResources:
    {{- range include "gpu-share.managedResources" . | fromJsonArray }}
    - name: {{ $domain }}/{{ . }}
    {{- end }}
- urlPrefix: https://gpu-share-extender.{{ .Release.Namespace }}.svc:{{ .Values.extender.port }}/all
  filterVerb: filter
  prioritizeVerb: prioritize
  weight: 20
  httpTimeout: 5s
  nodeCacheCapable: true
  ignorable: true
  enableHTTPS: true
  tlsConfig:
    serverName: gpu-share-extender.{{ .Release.Namespace }}.svc
    certFile: /etc/gpu-share-scheduler-tls/tls.crt
    keyFile: /etc/gpu-share-scheduler-tls/tls.key
    caFile: /etc/gpu-share-scheduler-tls/ca.crt
{{- end -}}

{{- define "gpu-share.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* Labels of every object; `component` names the part (gpu-share, gpu-share-mps, gpu-share-extender, ...). */}}
{{- define "gpu-share.labels" -}}
app.kubernetes.io/name: {{ .component }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: gpu-share
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{/* The config's MPS pools: {"pools": {pool name: [the profiles that have it]}, "exclusive": {pool name: true} for
those with exclusiveProcess, "default": defaultProfile}. */}}
{{- define "gpu-share.mpsPools" -}}
{{- $config := include "gpu-share.configData" . | fromJson -}}
{{- $profiles := dict -}}
{{- if $config.pools -}}{{- $_ := set $profiles "default" $config.pools -}}{{- end -}}
{{- range $name, $body := ($config.profiles | default dict) -}}{{- $_ := set $profiles $name $body.pools -}}{{- end -}}
{{- $found := dict "pools" (dict) "exclusive" (dict) -}}
{{- range $name, $pools := $profiles -}}
{{- range $pool := $pools -}}
{{- if eq (toString $pool.backend) "mps" -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$" (toString $pool.name)) -}}{{- /* the plugin's POOL_NAME (config/paths.py) */}}
{{- fail (printf "config: profile %s: an MPS pool's name must be 1-40 characters of [a-z0-9-], starting and ending alphanumeric, got %q" $name (toString $pool.name)) -}}
{{- end -}}
{{- $_ := set $found.pools $pool.name (append (get $found.pools $pool.name | default list) $name) -}}
{{- if $pool.exclusiveProcess -}}{{- $_ := set $found.exclusive $pool.name true -}}{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $_ := set $found "default" ($config.defaultProfile | default "default") -}}
{{- toJson $found -}}
{{- end -}}

{{/* The objects of files/dra/<.file> (daemonset/dra/'s, linked) as a JSON list, for the release: the domain in its
CEL expressions (they quote it alone, 'example.com', for kustomize's replacements too), the chart's labels, the
release namespace on the ServiceAccount and the ClusterRoleBinding's subjects. */}}
{{- define "gpu-share.draObjects" -}}
{{- $domain := include "gpu-share.domain" .root -}}
{{- $text := .root.Files.Get (printf "files/dra/%s" .file) | replace "'example.com'" (squote $domain) | replace "\"gpu-share.example.com\"" (printf "\"gpu-share.%s\"" $domain) -}}
{{- $objects := list -}}
{{- range regexSplit "(?m)^---$" $text -1 -}}
{{- $object := fromYaml . -}}
{{- if $object -}}
{{- $_ := set $object.metadata "labels" (include "gpu-share.labels" (dict "root" $.root "component" "gpu-share-dra") | fromYaml) -}}
{{- if eq $object.kind "ServiceAccount" -}}
{{- $_ := set $object.metadata "namespace" $.root.Release.Namespace -}}
{{- end -}}
{{- range ($object.subjects | default list) -}}
{{- $_ := set . "namespace" $.root.Release.Namespace -}}
{{- end -}}
{{- $objects = append $objects $object -}}
{{- end -}}
{{- end -}}
{{- toJson $objects -}}
{{- end -}}

{{/* Each component's built-in pod settings: what it gets where neither its own key nor the top-level one is set
(values.yaml's comments list them; the kustomization's manifests hold the same). */}}
{{- define "gpu-share.builtins" -}}
plugin:
  resources: {requests: {cpu: 20m, memory: 96Mi}, limits: {cpu: 500m, memory: 256Mi}}
  tolerations:
    - {key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}
    - {key: CriticalAddonsOnly, operator: Exists}
  updateStrategy: {type: RollingUpdate, rollingUpdate: {maxUnavailable: 1}}
mps:
  resources: {requests: {cpu: 10m, memory: 64Mi}, limits: {cpu: 500m, memory: 256Mi}}
  tolerations:
    - {key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}
  updateStrategy: {type: OnDelete}
dra:
  resources: {requests: {cpu: 20m, memory: 128Mi}, limits: {cpu: 500m, memory: 320Mi}}
  tolerations:
    - {key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}
    - {key: CriticalAddonsOnly, operator: Exists}
  updateStrategy: {type: RollingUpdate, rollingUpdate: {maxSurge: 1, maxUnavailable: 0}}
extender:
  resources: {requests: {cpu: 100m, memory: 128Mi}, limits: {cpu: "1", memory: 512Mi}}
scheduler:
  resources: {requests: {cpu: 100m, memory: 128Mi}, limits: {memory: 512Mi}}
{{- end -}}

{{/* A component's pod settings (nodeSelector, tolerations, affinity, resources, updateStrategy) as a JSON object:
each the component's own key when set (not empty), else the top-level key when set, else the built-in default above
(none: absent). The one place of the precedence values.yaml and docs/install.md state. */}}
{{- define "gpu-share.settings" -}}
{{- $own := get .root.Values .component -}}
{{- $builtin := get (include "gpu-share.builtins" .root | fromYaml) .component | default dict -}}
{{- $settings := dict -}}
{{- range list "nodeSelector" "tolerations" "affinity" "resources" "updateStrategy" -}}
{{- $value := coalesce (get $own .) (get $.root.Values .) (get $builtin .) -}}
{{- if $value }}{{ $_ := set $settings . $value }}{{ end -}}
{{- end -}}
{{- toJson $settings -}}
{{- end -}}

{{/* The config's shared pools as the capacity policy's CEL list (06-capacity-policy.yaml's `pools`, for its
message): [{'name': '<profile>/<pool>', 'replicas': 'N', 'mib': 'M'}], sorted by name; memoryPerShare in whole MiB
(the plugin's parse_quantity_mib), replicas 0 then, and the plugin's default of 10 replicas where neither is given. */}}
{{- define "gpu-share.sharedPools" -}}
{{- $config := include "gpu-share.configData" . | fromJson -}}
{{- $profiles := dict -}}
{{- if $config.pools -}}{{- $_ := set $profiles "default" $config.pools -}}{{- end -}}
{{- range $name, $body := ($config.profiles | default dict) -}}{{- $_ := set $profiles $name $body.pools -}}{{- end -}}
{{- $bytes := dict "" 1 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 -}}
{{- $entries := list -}}
{{- range $profile, $pools := $profiles -}}
{{- range $pool := $pools -}}
{{- if eq (toString $pool.mode) "shared" -}}
{{- $name := printf "%s/%s" $profile (toString $pool.name) -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?/[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$" $name) -}}
{{- fail (printf "config: profile and pool names must be 1-40 characters of [a-z0-9-], starting and ending alphanumeric, got %q" $name) -}}
{{- end -}}
{{- $mib := 0 -}}
{{- $replicas := $pool.replicas | default 10 -}}
{{- with $pool.memoryPerShare -}}
{{- $found := regexFindAll "^([0-9]+)(Ki|Mi|Gi|Ti|k|M|G|T)?$" (toString .) 1 -}}
{{- if not $found -}}
{{- fail (printf "config: profile %s: pool %s: memoryPerShare: must be a quantity such as 4Gi or 512Mi, got %q" $profile (toString $pool.name) (toString .)) -}}
{{- end -}}
{{- $unit := regexReplaceAll "^[0-9]+" (toString .) "" -}}
{{- $mib = div (mul (regexReplaceAll "[^0-9]" (toString .) "" | atoi) (get $bytes $unit)) 1048576 -}}
{{- $replicas = 0 -}}
{{- end -}}
{{- if not (regexMatch "^[0-9]+$" (toString $replicas)) -}}
{{- fail (printf "config: profile %s: pool %s: replicas: must be a whole number, got %v" $profile (toString $pool.name) $replicas) -}}
{{- end -}}
{{- $entries = append $entries (printf "{'name': '%s', 'replicas': '%v', 'mib': '%d'}" $name $replicas $mib) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- printf "[%s]" (join ", " (sortAlpha $entries)) -}}
{{- end -}}

{{/* The resources kube-scheduler calls the extender for (names after <domain>/): extender.managedResources, then
each resource the config's shared and exclusive pools advertise that the list lacks (a pool's `resource`, by
default gpu-share and gpu), so a config's own names (mig-share, t4-share, ...) are never left out. */}}
{{- define "gpu-share.managedResources" -}}
{{- $config := include "gpu-share.configData" . | fromJson -}}
{{- $pools := $config.pools | default list -}}
{{- range $_, $body := ($config.profiles | default dict) -}}{{- $pools = concat $pools ($body.pools | default list) -}}{{- end -}}
{{- $names := .Values.extender.managedResources -}}
{{- range $pools -}}
{{- $default := get (dict "shared" "gpu-share" "exclusive" "gpu") (toString .mode) -}}
{{- $name := toString (.resource | default $default) -}}
{{- if and $name (not (has $name $names)) -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9_.]*[a-z0-9])?$" $name) -}}
{{- fail (printf "config: pool %s: resource must be a resource name after <domain>/ such as gpu-share, got %q" (toString .name) $name) -}}
{{- end -}}
{{- $names = append $names $name -}}
{{- end -}}
{{- end -}}
{{- toJson $names -}}
{{- end -}}
