#!/usr/bin/env bash
# Prints the Secrets the manifests mount, each token 32 random bytes (hex), as YAML for
# `kubectl apply -f -`. No token is ever committed:
#
#   deploy/kubernetes/create-secrets.sh | kubectl apply -n <namespace> -f -
#
# inferencecache-tokens (server.yaml, replicated.yaml, vllm-with-sidecar.yaml): `controller`
# opens /snapshot, /probe and /digest, `policy` opens /policy, `producer` ReportCacheState and
# PublishEvent (the sidecars present it). inferencecache-nats-token (replicated.yaml): the token
# NATS demands and the index servers present. Re-running it rotates every token: apply, then
# restart the pods that mount them.
set -euo pipefail
token() { od -An -N 32 -tx1 /dev/urandom | tr -d ' \n'; }
cat <<YAML
apiVersion: v1
kind: Secret
metadata:
  name: inferencecache-tokens
  labels:
    app.kubernetes.io/name: inferencecache
type: Opaque
stringData:
  controller: "$(token)"
  policy: "$(token)"
  producer: "$(token)"
---
apiVersion: v1
kind: Secret
metadata:
  name: inferencecache-nats-token
  labels:
    app.kubernetes.io/name: inferencecache
    app.kubernetes.io/component: nats
type: Opaque
stringData:
  token: "$(token)"
YAML
