{{/* Chart name, truncated to the 63-char DNS label limit. */}}
{{- define "specmask.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-scoped base name; component names append a suffix, so keep room (<= 40). */}}
{{- define "specmask.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "specmask.mask.name" -}}{{ include "specmask.fullname" . }}-mask{{- end }}
{{- define "specmask.mask.headless" -}}{{ include "specmask.fullname" . }}-mask-headless{{- end }}
{{- define "specmask.orchestrator.name" -}}{{ include "specmask.fullname" . }}-orchestrator{{- end }}
{{- define "specmask.ray.name" -}}{{ include "specmask.fullname" . }}-ray{{- end }}

{{- define "specmask.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "specmask.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "specmask.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "specmask.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: specmask
{{- end }}

{{/* Selector labels of one component: (dict "ctx" $ "component" "mask-service"). */}}
{{- define "specmask.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specmask.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* repository:tag, or repository@digest when a digest is pinned (the tag is then ignored). */}}
{{- define "specmask.image" -}}
{{- if .digest }}
{{- printf "%s@%s" .repository .digest }}
{{- else }}
{{- printf "%s:%s" .repository .tag }}
{{- end }}
{{- end }}

{{/* Pod-level extension points of one component's values (labels/annotations go in metadata). */}}
{{- define "specmask.podExtras" -}}
{{- with .priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
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
{{- end }}

{{/* Container env: the component's env list as given (value or valueFrom). */}}
{{- define "specmask.env" -}}
{{- range . }}
- {{ toYaml . | nindent 2 | trim }}
{{- end }}
{{- end }}

{{/* Ray token auth: the Secret holding auth_token (KubeRay's key). */}}
{{- define "specmask.ray.authSecret" -}}
{{- default (printf "%s-auth" (include "specmask.ray.name" .)) .Values.rayCluster.auth.existingSecret }}
{{- end }}

{{/* GpuWorker actors each orchestrator replica starts with: orchestrator.numWorkers, or the
GPUs the worker group always has (minReplicas x gpusPerWorker) shared by the replicas, at least
1; 1 with an external Ray cluster. */}}
{{- define "specmask.numWorkers" -}}
{{- $o := .Values.orchestrator }}
{{- if $o.numWorkers }}
{{- $o.numWorkers }}
{{- else if .Values.rayCluster.enabled }}
{{- max 1 (div (mul (int .Values.rayCluster.gpuWorkers.minReplicas) (int .Values.rayCluster.gpuWorkers.gpusPerWorker)) (int $o.replicas)) }}
{{- else }}
{{- 1 }}
{{- end }}
{{- end }}

{{/* GpuWorker actors per replica under load (workerAutoscaling.maxWorkers, or the GPUs the
worker group can ever have shared by the replicas, at least numWorkers). */}}
{{- define "specmask.maxWorkers" -}}
{{- $o := .Values.orchestrator }}
{{- $a := $o.workerAutoscaling }}
{{- if $a.maxWorkers }}
{{- $a.maxWorkers }}
{{- else if .Values.rayCluster.enabled }}
{{- max (int (include "specmask.numWorkers" .)) (div (mul (int .Values.rayCluster.gpuWorkers.maxReplicas) (int .Values.rayCluster.gpuWorkers.gpusPerWorker)) (int $o.replicas)) }}
{{- else }}
{{- include "specmask.numWorkers" . }}
{{- end }}
{{- end }}

{{/* The pooled workers' name (--worker-pool): the release's, as a Ray actor name part. */}}
{{- define "specmask.workerPool" -}}
{{- include "specmask.fullname" . | replace "." "-" | trunc 40 | trimSuffix "-" }}
{{- end }}

{{/* GpuWorker actors per replica when idle (workerAutoscaling.minWorkers, or numWorkers). */}}
{{- define "specmask.minWorkers" -}}
{{- $a := .Values.orchestrator.workerAutoscaling }}
{{- if $a.minWorkers }}
{{- $a.minWorkers }}
{{- else }}
{{- include "specmask.numWorkers" . }}
{{- end }}
{{- end }}

{{/* Model volume (read-only). */}}
{{- define "specmask.modelVolume" -}}
{{- include "specmask.modelVolumeOf" (dict "ctx" . "writable" false) }}
{{- end }}

{{/* Model volume; writable: only the pod whose download initContainer fills it (its
other containers still mount it read-only). */}}
{{- define "specmask.modelVolumeOf" -}}
{{- $models := .ctx.Values.models }}
- name: models
{{- if eq $models.volume.type "pvc" }}
  persistentVolumeClaim:
    claimName: {{ $models.volume.pvc.claimName }}
    {{- if not .writable }}
    readOnly: true
    {{- end }}
{{- else }}
  hostPath:
    path: {{ $models.volume.hostPath.path }}
    type: Directory
{{- end }}
{{- end }}

{{/* models.download, checked: what it downloads and where, or nothing when off. */}}
{{- define "specmask.download.check" -}}
{{- $m := .Values.models }}
{{- if $m.download.enabled }}
{{- if ne $m.volume.type "pvc" }}
{{- fail "models.download needs models.volume.type=pvc (a claim every pod mounts, ReadWriteMany): a hostPath is one node's, so the other pods would never see the files" }}
{{- end }}
{{- if not $m.download.target }}
{{- fail "models.download.enabled needs models.download.target (the target's Hub repo id)" }}
{{- end }}
{{- if and $m.download.draft (not $m.draft) }}
{{- fail "models.download.draft is set but models.draft is \"\" (no draft dir to download into)" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The marker a finished download leaves in a model dir: its repo id and revision. */}}
{{- define "specmask.download.marker" -}}.specmask-download{{- end }}

{{- define "specmask.modelMount" -}}
- name: models
  mountPath: {{ .Values.models.mountPath }}
  readOnly: true
{{- end }}

{{- define "specmask.targetDir" -}}{{ printf "%s/%s" (.Values.models.mountPath | trimSuffix "/") .Values.models.target }}{{- end }}
{{- define "specmask.draftDir" -}}{{ printf "%s/%s" (.Values.models.mountPath | trimSuffix "/") .Values.models.draft }}{{- end }}

{{/* --mask-service value: explicit list, else the headless Service (one dns:/// target). */}}
{{- define "specmask.maskServiceAddresses" -}}
{{- if .Values.orchestrator.maskServiceAddresses }}
{{- join "," .Values.orchestrator.maskServiceAddresses }}
{{- else }}
{{- printf "dns:///%s.%s.svc.cluster.local:%d" (include "specmask.mask.headless" .) .Release.Namespace (int .Values.maskService.port) }}
{{- end }}
{{- end }}

{{- define "specmask.rayAddress" -}}
{{- if .Values.orchestrator.rayAddress }}
{{- .Values.orchestrator.rayAddress }}
{{- else if .Values.rayCluster.enabled }}
{{- printf "ray://%s-head-svc.%s.svc.cluster.local:10001" (include "specmask.ray.name" .) .Release.Namespace }}
{{- else }}
{{- fail "orchestrator.rayAddress is required when rayCluster.enabled is false" }}
{{- end }}
{{- end }}

{{- define "specmask.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "specmask.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* One rayStartParams value as the quoted string KubeRay wants. Helm reads
YAML numbers as float64 (100000000 -> "1e+08"), so integers go through int64. */}}
{{- define "specmask.rayParam" -}}
{{- if and (kindIs "float64" .) (eq (float64 (int64 .)) .) }}{{ int64 . | toString | quote }}{{ else }}{{ . | toString | quote }}{{ end }}
{{- end }}

{{/* gRPC health service name for startup/liveness probes: the process alone
(specmask/proto/health.py LIVENESS); readiness probes ask "" (dependencies). */}}
{{- define "specmask.livenessService" -}}
specmask.liveness
{{- end }}

{{/* Ray containers: as the others (non-root, no privilege escalation, no
capabilities, RuntimeDefault seccomp), except the root filesystem: Ray writes
under $HOME and /tmp besides /tmp/ray, so it stays writable. */}}
{{- define "specmask.ray.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: false
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* Mask-service token Secret (key "token") and the env entry every party gets. */}}
{{- define "specmask.mask.tokenSecret" -}}
{{- default (printf "%s-token" (include "specmask.mask.name" .)) .Values.maskService.auth.existingSecret }}
{{- end }}
{{- define "specmask.mask.tokenEnv" -}}
{{- if .Values.maskService.auth.enabled }}
- name: SPECMASK_MASK_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "specmask.mask.tokenSecret" . }}
      key: token
{{- end }}
{{- end }}
{{- define "specmask.orchestrator.apiKeySecret" -}}
{{- default (printf "%s-api-keys" (include "specmask.orchestrator.name" .)) .Values.orchestrator.apiKeys.existingSecret }}
{{- end }}
