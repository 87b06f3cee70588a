{{/*
Names, labels and the small computed values every template shares.
*/}}

{{- define "kvtopo.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The release's resource name prefix: the release name when it already contains the chart
name (release "kvtopo" -> "kvtopo"), else "<release>-<chart>". Kept short enough for the
longest suffix appended to it ("-worker-control", 15 characters) to fit in 63.
*/}}
{{- define "kvtopo.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 48 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvtopo.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvtopo.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvtopo.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/*
Labels of every object; kvtopo.labels adds the operator's component label.
*/}}
{{- define "kvtopo.commonLabels" -}}
helm.sh/chart: {{ include "kvtopo.chart" . }}
app.kubernetes.io/name: {{ include "kvtopo.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvtopo
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "kvtopo.labels" -}}
{{ include "kvtopo.commonLabels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "kvtopo.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvtopo.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvtopo.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/*
The operator's private key Secret (release namespace) and its public key ConfigMap (every
engine namespace): the chart's own ("<fullname>-operator-key") or existing ones.
*/}}
{{- define "kvtopo.operatorKeySecretName" -}}
{{- default (printf "%s-operator-key" (include "kvtopo.fullname" .)) .Values.operatorKey.existingSecret }}
{{- end }}

{{- define "kvtopo.operatorKeyConfigMapName" -}}
{{- default (printf "%s-operator-key" (include "kvtopo.fullname" .)) .Values.operatorKey.existingConfigMap }}
{{- end }}

{{- define "kvtopo.peeringName" -}}
{{- default (include "kvtopo.fullname" .) .Values.peering.name }}
{{- end }}

{{/*
The leader-election Lease, in the release namespace ("<fullname>-operator" by default).
*/}}
{{- define "kvtopo.leaseName" -}}
{{- default (printf "%s-operator" (include "kvtopo.fullname" .)) .Values.leaderElection.leaseName }}
{{- end }}

{{/*
The namespaces where engine pods run, as a JSON list (use with fromJsonArray): the values'
engineNamespaces, else the release namespace. In namespace scope the operator watches
exactly these and is granted Roles only there; in cluster scope it watches every namespace
and these only say where the NetworkPolicy and the operator's public key ConfigMap go.
*/}}
{{- define "kvtopo.engineNamespaces" -}}
{{- if .Values.engineNamespaces }}
{{- .Values.engineNamespaces | uniq | toJson }}
{{- else }}
{{- list .Release.Namespace | toJson }}
{{- end }}
{{- end }}

{{/*
Label selector of engine pods: the operator's pod watch filters on this label server-side.
*/}}
{{- define "kvtopo.enginePodSelector" -}}
matchExpressions:
  - key: kvtopo.dev/role
    operator: In
    values: [prefill, decode]
{{- end }}

{{/*
The permissions the operator needs, in every namespace it watches (Role) or cluster-wide
(ClusterRole). Exactly the verbs the operator calls (tests/helm/test_rbac_e2e.py compares
them with the API server's audit log of a real run), nothing else: no Secrets (the worker
token is a mounted file), no writes to pods other than one condition, no nodes.
  - pods: the engine-pod watch (a paged list + watch; pods are never read one by one).
  - pods/status: the readiness gate kvtopo.dev/kv-connected (a strategic merge patch of
    that one condition, on pods that list the gate).
  - kvtopologies: kopf's list + watch (each round reads its topology from the watch, never
    with a get). kopf stores nothing on them (only event and index handlers, no
    finalizers): no patch.
  - kvtopologies/status: the single status writer (the leading replica's loop: a merge
    patch of the whole status through the subresource, conditional on the resourceVersion
    of its own last write, at most once a second).
  - events: the operator's and kopf's Events (always created, never patched).
*/}}
{{- define "kvtopo.rbacRules" -}}
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch]
- apiGroups: [""]
  resources: [pods/status]
  verbs: [patch]
- apiGroups: [kvtopo.dev]
  resources: [kvtopologies]
  verbs: [list, watch]
- apiGroups: [kvtopo.dev]
  resources: [kvtopologies/status]
  verbs: [patch]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end }}

{{/*
kopf peering (only with peering.enabled): watch the peering objects, and get/patch only the
release's own one (kopf writes its keep-alives into it).
*/}}
{{- define "kvtopo.peeringRules" -}}
{{- $resource := ternary "clusterkopfpeerings" "kopfpeerings" (eq .Values.scope "cluster") }}
- apiGroups: [kopf.dev]
  resources: [{{ $resource }}]
  verbs: [list, watch]
- apiGroups: [kopf.dev]
  resources: [{{ $resource }}]
  resourceNames: [{{ include "kvtopo.peeringName" . | quote }}]
  verbs: [get, patch]
{{- end }}

{{/*
Leader election (only with leaderElection.enabled), in the release namespace: create a Lease
(RBAC cannot limit create to a name), get and update only the release's own one. The
operator never lists, watches, patches or deletes Leases.
*/}}
{{- define "kvtopo.leaderElectionRules" -}}
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  verbs: [create]
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  resourceNames: [{{ include "kvtopo.leaseName" . | quote }}]
  verbs: [get, update]
{{- end }}

{{/*
Rules that span several values (values.schema.json checks each value on its own).
*/}}
{{- define "kvtopo.validate" -}}
{{- if ne (empty .Values.operatorKey.existingSecret) (empty .Values.operatorKey.existingConfigMap) }}
{{- fail "operatorKey.existingSecret and operatorKey.existingConfigMap go together (the private key and its public key), or neither (the chart generates both)" }}
{{- end }}
{{- if and .Values.metrics.serviceMonitor.enabled (not .Values.metrics.enabled) }}
{{- fail "metrics.serviceMonitor.enabled=true needs metrics.enabled=true (the ServiceMonitor scrapes the metrics Service)" }}
{{- end }}
{{- if and .Values.metrics.enabled (eq (int .Values.metrics.port) (int .Values.health.port)) }}
{{- fail (printf "metrics.port and health.port must differ (both are %v)" .Values.metrics.port) }}
{{- end }}
{{- if and (not .Values.serviceAccount.create) (not .Values.serviceAccount.name) }}
{{- fail "serviceAccount.create=false needs serviceAccount.name (an existing ServiceAccount; never the namespace's default)" }}
{{- end }}
{{- $le := .Values.leaderElection }}
{{- if and (gt (int .Values.replicaCount) 1) (not $le.enabled) }}
{{- fail (printf "replicaCount=%v needs leaderElection.enabled=true (without it every replica would reconcile)" .Values.replicaCount) }}
{{- end }}
{{- if and $le.enabled .Values.peering.enabled }}
{{- fail "peering.enabled=true needs leaderElection.enabled=false and replicaCount=1 (kopf's peering pauses every replica of equal priority, the standbys and the leader alike)" }}
{{- end }}
{{- if and $le.enabled (ge (float64 $le.renewDeadlineSeconds) (float64 $le.leaseSeconds)) }}
{{- fail (printf "leaderElection.renewDeadlineSeconds (%v) must be below leaderElection.leaseSeconds (%v)" $le.renewDeadlineSeconds $le.leaseSeconds) }}
{{- end }}
{{- if and $le.enabled (ge (float64 $le.retryPeriodSeconds) (float64 $le.renewDeadlineSeconds)) }}
{{- fail (printf "leaderElection.retryPeriodSeconds (%v) must be below leaderElection.renewDeadlineSeconds (%v)" $le.retryPeriodSeconds $le.renewDeadlineSeconds) }}
{{- end }}
{{- end }}
