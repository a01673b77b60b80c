#!/usr/bin/env bash
# shellcheck disable=SC2317  # functions are called by name from wait_for, the trap and the modes
# The deployment smoke test: build the image, start deploy/ for real, push a burst of tasks
# through it while a worker is killed (SIGKILL) and PostgreSQL restarts, and check that every
# task ended `done` with no row left `in_progress`. It uses no `worker` command of the host.
#
#   deploy/smoke.sh [compose|podman|kubernetes] [--tasks N] [--keep]
#   deploy/smoke.sh manifests podman|kubernetes        (print what would be applied, and exit)
#
#   compose     docker-compose.yml (`docker compose` or docker-compose 1.29) on the local engine:
#               postgres, migrate and two workers
#   podman      the Kubernetes pod specs under `podman kube play`: the migrate Job's pod spec as
#               a Pod restarted on failure (podman runs no Job), the worker Deployment (once
#               per replica, each with a host port of its own), a PostgreSQL pod
#   kubernetes  `kubectl apply` of the manifests to the current context, in a namespace of its
#               own (kind and k3d clusters get the image loaded; elsewhere set SMOKE_IMAGE to an
#               image the cluster can pull), with a PostgreSQL Deployment
#
# It never pulls: the base images (the Dockerfile's FROM and postgres:16) must be in the local
# engine (docs/howto/deploying.md says how to build them without a registry), unless
# SMOKE_PULL=1. The podman and kubernetes modes transform the manifests with Python and PyYAML
# ($PYTHON, default python3; the project's .venv/bin/python has PyYAML).
#
# One verdict line on stdout, and the exit code:
#   smoke MODE: PASS ...   0
#   smoke MODE: FAIL ...   1   (what failed; the stack is left up with --keep)
#   usage error            2
#   smoke MODE: SKIP ...   3   (cannot run here: no engine, no cluster, a missing base image)
# Progress goes to stderr. SMOKE_TASKS (50000), SMOKE_TIMEOUT (600 s per wait) and SMOKE_IMAGE
# (worker:local) change what it does.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
MODE=compose
KEEP=0
TASKS=${SMOKE_TASKS:-50000}
TIMEOUT=${SMOKE_TIMEOUT:-600}
IMAGE=${SMOKE_IMAGE:-}
PYTHON=${PYTHON:-python3}
RUN_ID="smoke-$(date +%s)-$$"
PROJECT="worker-smoke-$$"
NS="worker-smoke-$$"
STARTED=0
NOTES=()

usage() {
  echo "usage: deploy/smoke.sh [compose|podman|kubernetes] [--tasks N] [--keep]" >&2
  echo "       deploy/smoke.sh manifests podman|kubernetes" >&2
  exit 2
}

if [ "${1:-}" = manifests ]; then
  if [ $# -ne 2 ] || { [ "$2" != podman ] && [ "$2" != kubernetes ]; }; then usage; fi
  MODE=manifests
  TARGET=$2
  shift 2
elif [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
  case $1 in compose | podman | kubernetes) MODE=$1 ;; *) usage ;; esac
  shift
fi
while [ $# -gt 0 ]; do
  case $1 in
    --tasks)
      if [ $# -lt 2 ] || ! [ "$2" -gt 0 ] 2>/dev/null; then usage; fi
      TASKS=$2
      shift 2 ;;
    --keep) KEEP=1; shift ;;
    *) usage ;;
  esac
done

say() { echo "smoke: $*" >&2; }
verdict() {  # verdict PASS|FAIL|SKIP message...: the one line on stdout, then exit
  local code status=$1
  shift
  case $status in PASS) code=0 ;; FAIL) code=1 ;; *) code=3 ;; esac
  echo "smoke $MODE: $status $* ($(date -u +%Y-%m-%dT%H:%MZ))"
  exit "$code"
}
fail() { verdict FAIL "$*"; }
skip() { verdict SKIP "$*"; }

# Poll `$@` until it succeeds, for at most TIMEOUT seconds.
wait_for() {
  local what=$1 deadline=$((SECONDS + TIMEOUT))
  shift
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || return 1
    sleep 2
  done
  say "$what"
}

# -- manifests for podman and kubernetes, from deploy/k8s -----------------------------------------

manifests() {  # manifests podman|kubernetes: the YAML documents to apply, on stdout
  "$PYTHON" - "$1" "$IMAGE" "$TASKS" <<'PY'
import copy
import sys
from pathlib import Path

import yaml

mode, image, _ = sys.argv[1:]
k8s = Path("deploy/k8s")


def load(name):
    return [d for d in yaml.safe_load_all((k8s / name).read_text()) if d]


def one(name, kind):
    (doc,) = [d for d in load(name) if d["kind"] == kind]
    return doc


DSN = {
    "dsn": "postgresql://worker:worker@{host}/worker",
    "migrate-dsn": "postgresql://worker:worker@{host}/worker",
}
# podman pods reach PostgreSQL through the host port it publishes; cluster pods through its
# Service.
host = "host.containers.internal:15432" if mode == "podman" else "smoke-postgres:5432"


def adapt(spec):
    """A pod spec of deploy/k8s as the smoke runs it: this image (never pulled from a registry),
    the demo handlers that ship with it, a CPU request a small cluster can grant, and (podman,
    which reads no Secret objects) the DSNs as plain values."""
    spec = copy.deepcopy(spec)
    for c in spec["containers"]:
        c["image"] = image
        c["imagePullPolicy"] = "IfNotPresent" if mode == "kubernetes" else "Never"
        args = c.get("args", [])
        if args[:1] == ["run"]:
            args[1] = "worker.dev.demo_tasks"
        c.setdefault("resources", {}).setdefault("requests", {})["cpu"] = "100m"
        for env in c.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref and mode == "podman":
                env.pop("valueFrom")
                env["value"] = DSN[ref["key"]].format(host=host)
    return spec


postgres_container = {
    "name": "postgres",
    "image": "postgres:16",
    "imagePullPolicy": "IfNotPresent" if mode == "kubernetes" else "Never",
    "env": [
        {"name": "POSTGRES_USER", "value": "worker"},
        {"name": "POSTGRES_PASSWORD", "value": "worker"},
        {"name": "POSTGRES_DB", "value": "worker"},
        {"name": "PGDATA", "value": "/var/lib/postgresql/data/pgdata"},
    ],
    "ports": [{"containerPort": 5432}],
    "readinessProbe": {"exec": {"command": ["pg_isready", "-U", "worker", "-d", "worker"]}},
    "volumeMounts": [{"name": "data", "mountPath": "/var/lib/postgresql/data"}],
}
docs = []
if mode == "podman":
    pg = copy.deepcopy(postgres_container)
    pg["ports"][0]["hostPort"] = 15432
    docs.append(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "smoke-postgres", "labels": {"app": "smoke-postgres"}},
            "spec": {
                "containers": [pg],
                "volumes": [{"name": "data", "emptyDir": {}}],
            },
        }
    )
    # The Job's pod spec as a Pod, with the Job's restartPolicy (OnFailure): it is restarted
    # until it succeeds, as the Job's pod would be (all pods start at once, before PostgreSQL
    # answers).
    job = one("migrate-job.yaml", "Job")
    docs.append(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": job["metadata"]["name"], **{"labels": job["metadata"]["labels"]}},
            "spec": adapt(job["spec"]["template"]["spec"]),
        }
    )
    # podman before 4.7 publishes every containerPort on the host (hostPort = containerPort), so
    # two replicas of one Deployment collide on 9470: the Deployment is played once per replica,
    # each with one replica and a host port of its own (19470, 19471, ...).
    deployment = one("deployment.yaml", "Deployment")
    spec = adapt(deployment["spec"]["template"]["spec"])
    for i in range(deployment["spec"]["replicas"]):
        one_replica = copy.deepcopy(deployment)
        if i:
            one_replica["metadata"]["name"] += f"-{i + 1}"
        one_replica["spec"]["replicas"] = 1
        one_replica["spec"]["template"]["spec"] = copy.deepcopy(spec)
        for c in one_replica["spec"]["template"]["spec"]["containers"]:
            for port in c.get("ports", []):
                port["hostPort"] = 10000 + port["containerPort"] + i
        docs.append(one_replica)
else:
    docs.append(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "worker-db"},
            "type": "Opaque",
            "stringData": {
                **{k: v.format(host=host) for k, v in DSN.items()},
                "keda-connection": DSN["dsn"].format(host=host),
            },
        }
    )
    labels = {"app": "smoke-postgres"}
    docs.append(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "smoke-postgres"},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": dict(labels)},
                "template": {
                    "metadata": {"labels": dict(labels)},
                    "spec": {
                        "containers": [postgres_container],
                        "volumes": [{"name": "data", "emptyDir": {}}],
                    },
                },
            },
        }
    )
    docs.append(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "smoke-postgres"},
            "spec": {"selector": labels, "ports": [{"port": 5432, "targetPort": 5432}]},
        }
    )
    job = one("migrate-job.yaml", "Job")
    job["spec"]["template"]["spec"] = adapt(job["spec"]["template"]["spec"])
    docs.append(job)
    for doc in load("deployment.yaml") + load("pdb.yaml"):
        if doc["kind"] == "Deployment":
            doc["spec"]["template"]["spec"] = adapt(doc["spec"]["template"]["spec"])
        docs.append(doc)
print(yaml.safe_dump_all(docs, sort_keys=False), end="")
PY
}

need_yaml() {
  "$PYTHON" -c "import yaml" >/dev/null 2>&1 \
    || skip "$PYTHON has no PyYAML (set PYTHON=.venv/bin/python, or install PyYAML)"
}

# podman keeps local images under localhost/.
if [ -z "$IMAGE" ]; then
  case $MODE:${TARGET:-} in podman:* | manifests:podman) IMAGE=localhost/worker:local ;; *) IMAGE=worker:local ;; esac
fi

if [ "$MODE" = manifests ]; then
  need_yaml
  manifests "$TARGET" || exit 1
  exit 0
fi

# -- the engines ------------------------------------------------------------------------------------

ENGINE=docker
[ "$MODE" = podman ] && ENGINE=podman

check_engine() {
  command -v "$ENGINE" >/dev/null 2>&1 || skip "no $ENGINE command on this machine"
  local why
  if ! why=$("$ENGINE" info 2>&1 >/dev/null); then
    skip "no container engine answers ($ENGINE info: $(echo "$why" | grep -m1 -v '^$'))"
  fi
}

base_images() {  # the images the build and the stack start from
  sed -n 's/^FROM \([^ ]*\).*/\1/p' deploy/Dockerfile
  echo postgres:16
}

check_base_images() {
  local image missing=()
  for image in $(base_images); do
    "$ENGINE" image inspect "$image" >/dev/null 2>&1 || missing+=("$image")
  done
  [ ${#missing[@]} -eq 0 ] && return
  if [ "${SMOKE_PULL:-0}" = 1 ]; then
    for image in "${missing[@]}"; do
      "$ENGINE" pull "$image" >&2 || skip "cannot pull $image"
    done
  else
    skip "base image(s) not in the local $ENGINE: ${missing[*]} ($ENGINE pull them, or build" \
      "them without a registry as docs/howto/deploying.md shows; SMOKE_PULL=1 lets it pull)"
  fi
}

build_image() {
  say "building $IMAGE"
  "$ENGINE" build -f deploy/Dockerfile -t "$IMAGE" . >&2 || fail "the image does not build"
  local who spec
  who=$("$ENGINE" run --rm --entrypoint id "$IMAGE") || fail "cannot run the image"
  [ "$who" = "uid=10001(worker) gid=10001(worker) groups=10001(worker)" ] \
    || fail "the image runs as '$who', not worker:worker (10001:10001)"
  spec=$("$ENGINE" run --rm --entrypoint python "$IMAGE" -c \
    "import importlib.util as u; print(u.find_spec('pgserver') is None)")
  [ "$spec" = True ] || fail "the image carries pgserver (the embedded extra)"
  NOTES+=("image $("$ENGINE" image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%d MB", $1/1e6}') as uid/gid 10001:10001 without pgserver")
}

# -- compose ----------------------------------------------------------------------------------------

compose() {
  if docker compose version >/dev/null 2>&1; then
    docker compose -p "$PROJECT" -f deploy/docker-compose.yml "$@"
  else
    docker-compose -p "$PROJECT" -f deploy/docker-compose.yml "$@"
  fi
}

compose_ids() {  # container ids of a compose service, stopped ones included, oldest first
  docker ps -a --filter "label=com.docker.compose.project=$PROJECT" \
    --filter "label=com.docker.compose.service=$1" --format '{{.CreatedAt}}\t{{.ID}}' \
    | sort | cut -f2
}

check_compose() {
  docker compose version >/dev/null 2>&1 || docker-compose version >/dev/null 2>&1 \
    || skip "neither \`docker compose\` nor docker-compose is installed"
}

compose_up() {
  say "starting postgres, migrate and 2 workers (project $PROJECT)"
  STARTED=1
  compose up -d --no-build --scale worker=2 worker >&2 || fail "compose up failed"
}

compose_down() { compose down -v --remove-orphans >/dev/null 2>&1; }
pg_ref() { compose_ids postgres | head -1; }
worker_refs() { compose_ids worker; }
migrate_ref() { compose_ids migrate | head -1; }
x_exec() { docker exec -i "$@"; }
x_logs() { docker logs "$1" 2>&1; }
migrate_done() { [ "$(docker inspect -f '{{.State.Status}} {{.State.ExitCode}}' "$(migrate_ref)")" = "exited 0" ]; }
healthy() { [ "$(docker inspect -f '{{.State.Health.Status}}' "$1" 2>/dev/null)" = healthy ]; }
kill_worker() { docker kill -s KILL "$1" >/dev/null && sleep 3 && docker start "$1" >/dev/null; }
restart_postgres() { docker restart "$(pg_ref)" >/dev/null; }

# -- podman (kube play) ------------------------------------------------------------------------------

podman_up() {
  need_yaml
  say "playing the pod specs with podman kube play"
  STARTED=1
  manifests podman >"$TMP/play.yaml" || fail "cannot make the pod specs"
  podman kube play "$TMP/play.yaml" >&2 || fail "podman kube play failed"
}
podman_down() { podman kube down "$TMP/play.yaml" >/dev/null 2>&1; }
if [ "$MODE" = podman ]; then
  # Containers by pod (`--pod`, without which podman 4 leaves .PodName empty): the infra
  # containers have no image of ours.
  in_pods() { podman ps -a --pod --format '{{.ID}} {{.PodName}} {{.Image}}' | awk -v img="$1" '$3 ~ img'; }
  pg_ref() { in_pods postgres | awk '$2 == "smoke-postgres" {print $1; exit}'; }
  worker_refs() { in_pods "$IMAGE" | awk '$2 != "worker-migrate" {print $1}'; }
  migrate_ref() { in_pods "$IMAGE" | awk '$2 == "worker-migrate" {print $1; exit}'; }
  x_exec() { podman exec -i "$@"; }
  x_logs() { podman logs "$1" 2>&1; }
  migrate_done() { [ "$(podman inspect -f '{{.State.Status}} {{.State.ExitCode}}' "$(migrate_ref)")" = "exited 0" ]; }
  healthy() { x_exec "$1" python -c "import urllib.request as r; r.urlopen('http://127.0.0.1:9470/readyz', timeout=3)"; }
  kill_worker() { podman kill -s KILL "$1" >/dev/null && sleep 3 && podman start "$1" >/dev/null; }
  restart_postgres() { podman restart "$(pg_ref)" >/dev/null; }
fi

# -- kubernetes (kubectl) ----------------------------------------------------------------------------

kube() { kubectl -n "$NS" "$@"; }
kube_up() {
  need_yaml
  command -v kubectl >/dev/null 2>&1 || skip "no kubectl command on this machine"
  kubectl version >/dev/null 2>&1 \
    || skip "no Kubernetes cluster answers (kubectl version: $(kubectl version 2>&1 | tail -1))"
  local ctx
  ctx=$(kubectl config current-context 2>/dev/null)
  case $ctx in
    kind-*) say "loading $IMAGE into kind cluster ${ctx#kind-}"
      kind load docker-image "$IMAGE" --name "${ctx#kind-}" >&2 || fail "kind load failed" ;;
    k3d-*) say "importing $IMAGE into k3d cluster ${ctx#k3d-}"
      k3d image import "$IMAGE" -c "${ctx#k3d-}" >&2 || fail "k3d image import failed" ;;
    *) say "context $ctx: the cluster must be able to pull $IMAGE (SMOKE_IMAGE)" ;;
  esac
  manifests kubernetes >"$TMP/apply.yaml" || fail "cannot make the manifests"
  STARTED=1
  kubectl create namespace "$NS" >&2 || fail "cannot create namespace $NS"
  kube apply -f "$TMP/apply.yaml" >&2 || fail "kubectl apply failed"
  if kubectl get crd scaledobjects.keda.sh >/dev/null 2>&1; then
    kube apply -f deploy/k8s/keda-scaledobject.yaml >&2 || fail "the KEDA objects do not apply"
    NOTES+=("KEDA objects applied")
  fi
  kube wait --for=condition=complete --timeout="${TIMEOUT}s" job/worker-migrate >&2 \
    || fail "the migrate Job did not complete"
  kube rollout status deploy/worker --timeout="${TIMEOUT}s" >&2 || fail "the worker rollout did not finish"
}
kube_down() { kubectl delete namespace "$NS" --wait=false >/dev/null 2>&1; }
if [ "$MODE" = kubernetes ]; then
  pg_ref() { kube get pod -l app=smoke-postgres -o name | head -1; }
  worker_refs() { kube get pod -l app.kubernetes.io/component=worker -o name; }
  migrate_ref() { kube get pod -l app.kubernetes.io/component=migrate -o name | head -1; }
  x_exec() { local ref=$1; shift; kube exec -i "$ref" -- "$@"; }
  x_logs() { kube logs "$1" 2>&1; }
  migrate_done() { kube wait --for=condition=complete --timeout=1s job/worker-migrate; }
  healthy() { [ "$(kube get "$1" -o jsonpath='{.status.containerStatuses[0].ready}')" = true ]; }
  kill_worker() { kube delete "$1" --grace-period=0 --force >/dev/null 2>&1; }
  # SIGINT to the postmaster (PID 1): a fast shutdown; the kubelet restarts the container and
  # the emptyDir keeps the data.
  restart_postgres() { x_exec "$(pg_ref)" kill -INT 1; }
fi

# -- the run ---------------------------------------------------------------------------------------

TMP=$(mktemp -d)
cleanup() {
  if [ "$STARTED" = 1 ] && [ "$KEEP" = 0 ]; then
    say "removing the stack"
    case $MODE in compose) compose_down ;; podman) podman_down ;; kubernetes) kube_down ;; esac
  fi
  rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

psql_q() { x_exec "$(pg_ref)" psql -U worker -d worker -Atq -c "$1" 2>/dev/null; }

case $MODE in
  compose) check_engine; check_compose; check_base_images; build_image; compose_up ;;
  podman) check_engine; check_base_images; build_image; podman_up ;;
  kubernetes)
    if [ -z "${SMOKE_IMAGE:-}" ] && command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
      check_base_images
      build_image
    fi
    kube_up ;;
esac

wait_for "migrate finished" migrate_done || fail "migrate did not finish with exit 0"
wait_for "postgres answers" psql_q "SELECT 1" || fail "postgres does not answer"
want=$(find schema -name '[0-9]*.sql' | wc -l)
have=$(psql_q "SELECT count(*) FROM worker.schema_migrations")
[ "$have" = "$want" ] || fail "worker.schema_migrations holds $have migrations, schema/ has $want"
NOTES+=("migrate applied $have migrations")

mapfile -t WORKERS < <(worker_refs)
[ ${#WORKERS[@]} -ge 1 ] || fail "no worker container"
for w in "${WORKERS[@]}"; do
  wait_for "worker ${w##*/} healthy" healthy "$w" || fail "worker ${w##*/} never turned healthy"
done

# /healthz, /readyz and /metrics answer, and the database is up for the metrics server.
probe=$(x_exec "${WORKERS[0]}" python - <<'PY'
import urllib.request as r

for path in ("/healthz", "/readyz", "/metrics"):
    with r.urlopen("http://127.0.0.1:9470" + path, timeout=10) as resp:
        body = resp.read().decode()
        print(path, resp.status, "worker_database_up 1.0" in body)
PY
) || fail "a health or metrics endpoint does not answer: $probe"
echo "$probe" | grep -qx "/metrics 200 True" || fail "/metrics does not report the database up: $probe"
[ "$(echo "$probe" | grep -c ' 200 ')" = 3 ] || fail "an endpoint did not answer 200: $probe"

# The burst, enqueued from inside a worker container with the package's own API.
say "enqueueing $TASKS tasks"
x_exec "${WORKERS[0]}" python - "$RUN_ID" "$TASKS" <<'PY' >&2 || fail "cannot enqueue the burst"
import os
import sys

import psycopg

import worker

run, n = sys.argv[1], int(sys.argv[2])
with psycopg.connect(os.environ["WORKER_DSN"], autocommit=True) as conn:
    worker.enqueue_many(conn, "demo.resize_image", ({"smoke": run, "image": i} for i in range(n)))
PY

count() {  # count STATE: this run's tasks in that state
  psql_q "SELECT count(*) FROM worker.tasks WHERE payload->>'smoke' = '$RUN_ID' AND state = '$1'"
}
started() { [ "$(count "done")" -gt 0 ] || [ "$(count in_progress)" -gt 0 ]; }
wait_for "tasks running" started || fail "no task of the burst started"

# The victim's own tasks: those its processes (its worker rows, by host name) hold when it dies.
# They must come back once their leases lapse and end done, on a second attempt.
victim=${WORKERS[0]}
victim_host=$(x_exec "$victim" python -c "import socket; print(socket.gethostname())") \
  || fail "cannot read the host name of worker ${victim##*/}"
victim_workers=$(psql_q "SELECT string_agg(quote_literal(id::text), ',') FROM worker.workers
  WHERE host = '$victim_host' AND stopped_at IS NULL")
[ -n "$victim_workers" ] || fail "worker ${victim##*/} ($victim_host) has no row in worker.workers"
say "killing worker ${victim##*/} (SIGKILL)"
kill_worker "$victim" || fail "cannot kill worker ${victim##*/}"
orphans=$(psql_q "SELECT string_agg(id::text, ',') FROM worker.tasks
  WHERE payload->>'smoke' = '$RUN_ID' AND state = 'in_progress'
    AND worker_id::text IN ($victim_workers)")
at_kill=$(echo "${orphans:-}" | tr ',' '\n' | grep -c .)
say "it held $at_kill task(s) in progress"
[ "$at_kill" -gt 0 ] || fail "worker ${victim##*/} held no task of the burst when it was killed"
say "restarting postgres"
restart_postgres || fail "cannot restart postgres"
sleep 5

settled() { [ "$(count "done")" = "$TASKS" ] && [ "$(count in_progress)" = 0 ]; }
if ! wait_for "every task done" settled; then
  fail "after ${TIMEOUT}s: $(count "done") done, $(count in_progress) in_progress," \
    "$(count queued) queued, $(count failed) failed of $TASKS"
fi
stuck=$(psql_q "SELECT count(*) FROM worker.tasks WHERE state = 'in_progress'")
[ "$stuck" = 0 ] || fail "$stuck row(s) left in_progress"
retried=$(psql_q "SELECT count(*) FROM worker.tasks WHERE payload->>'smoke' = '$RUN_ID' AND attempts > 1")
rescued=$(psql_q "SELECT count(*) FROM worker.tasks WHERE id IN ($orphans) AND state = 'done'
  AND attempts > 1")
[ "$rescued" = "$at_kill" ] \
  || fail "of the $at_kill task(s) the killed worker held, $rescued ended done on a later attempt"

# The logs: the bind address said as bound, and (the demo password is `worker`, the product's
# name) no mask outside a DSN or password field.
logs=$(for ref in $(migrate_ref) $(worker_refs); do x_logs "$ref"; done)
echo "$logs" | grep -q "on 0.0.0.0:9470, every IPv4 address" \
  || fail "no worker log line names the bound address 0.0.0.0:9470"
masked=$(echo "$logs" | sed -E 's#://[^ :@/]*:\*\*\*@##g; s#password=\*\*\*##g' | grep -F '***')
[ -z "$masked" ] || fail "a log line masks a word: $(echo "$masked" | head -1)"

verdict PASS "$TASKS/$TASKS tasks done, 0 in_progress, $retried retried, after SIGKILL of a" \
  "worker holding $at_kill (all done on a later attempt) and a PostgreSQL restart;" \
  "$(printf '%s; ' "${NOTES[@]}" | sed 's/; $//')"
