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
- urlPrefix: http://gpu-share-extender.{{ .Release.Namespace }}.svc:{{ .Values.extender.port }}
  filterVerb: filter
  prioritizeVerb: prioritize
  weight: 20
  httpTimeout: 5s
  nodeCacheCapable: true
  ignorable: false
  managedResources:
    {{- range .Values.extender.managedResources }}
    - name: {{ $domain }}/{{ . }}
    {{- end }}
- urlPrefix: http://gpu-share-extender.{{ .Release.Namespace }}.svc:{{ .Values.extender.port }}/all
  filterVerb: filter
  prioritizeVerb: prioritize
  weight: 20
  httpTimeout: 5s
  nodeCacheCapable: true
  ignorable: true
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
