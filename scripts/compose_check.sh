#!/usr/bin/env bash
# deploy/docker-compose.yml under a real Docker daemon, faults included (run by .ci/run after the
# test suite). As root on a Debian machine; a fresh one gets what it needs here: docker.io,
# docker-compose and debootstrap from apt when missing, a dockerd started in the background (and
# stopped by PID at the end, also on failure) when none answers, stand-ins for the public base
# images when they cannot be pulled (scripts/compose_standin_images.sh, cached by the daemon), and
# the host's CA bundle and pip configuration in the image build (scripts/compose_pip_mirror.py).
# Then: the image, the cluster, the API through both front doors, a prefill worker killed under
# load, a Redis restart, 2 prefill + 2 decode workers, the colocated profile, and `down -v`.
#
#   scripts/compose_check.sh
#
# Prints one line per step, `compose-check: STEP ok (T s): what it saw`; at the first failure
# `compose-check: STEP FAILED (T s): why`, the tail of the services' logs, and exits 1. The full
# output goes to $COMPOSE_CHECK_LOG (default /tmp/pdrouter-compose-check.log).
#
# Variables (all optional): COMPOSE_CHECK_PROJECT (project name, default pdrouter-check); COMPOSE
# (default docker-compose; `docker compose` for v2); PYTHON (a python with the dev extra, default
# .venv/bin/python, which scripts/test.sh makes); BASE_IMAGE / REDIS_IMAGE (default: the
# Dockerfile's and compose file's, else stand-ins); TORCH_INDEX_URL (default: PyTorch's CPU index
# when it answers, else none: the CPU wheel from the configured indexes); PDROUTER_IMAGE (the tag
# built, default pd-router:latest); EXTRA_PACKAGES (more pip packages for the image, as the
# Dockerfile's build argument); DOCKER_DATA_ROOT (of a dockerd started here, default
# /var/lib/docker, so the image cache persists); KEEP=1 leaves the cluster and the daemon running.
set -Eeuo pipefail
cd "$(dirname "$0")/.."

PROJECT=${COMPOSE_CHECK_PROJECT:-pdrouter-check}
LOG=${COMPOSE_CHECK_LOG:-/tmp/pdrouter-compose-check.log}
PY=${PYTHON:-.venv/bin/python}
read -r -a COMPOSE_CMD <<<"${COMPOSE:-docker-compose}"
IMAGE=${PDROUTER_IMAGE:-pd-router:latest}
COMPOSE_FILE=deploy/docker-compose.yml
WORK=$(mktemp -d /tmp/pdrouter-compose-check.XXXXXX)

exec 3>&1 >"$LOG" 2>&1
STEP="start"
STEP_T0=$(date +%s.%N)
T0=$STEP_T0
DETAIL=""
STEPS=0
DOCKERD_PID=""
MIRROR_PID=""
LOAD_PID=""
CLUSTER_UP=""

say() { printf '%s\n' "$*" >&3; echo "$*"; }
elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
join() { local IFS=$1; shift; echo "$*"; }
# The first failure's reason is kept in a file: a failure inside $(...) happens in a subshell.
note_failure() { [ -s "$WORK/failure" ] || printf '%s' "$*" >"$WORK/failure"; }
fail() { note_failure "$*"; exit 1; }
trap 'note_failure "\`$BASH_COMMAND\` failed (exit $?, line $LINENO)"' ERR

dc() { timeout "${DC_TIMEOUT:-420}" "${COMPOSE_CMD[@]}" -p "$PROJECT" -f "$COMPOSE_FILE" "$@"; }
dc_all() { dc --profile colocated "$@"; }

step() {  # step NAME FUNCTION: run it; one summary line (its DETAIL) when it returns
  STEP=$1
  DETAIL=""
  STEP_T0=$(date +%s.%N)
  echo "== $STEP"
  "$2"
  STEPS=$((STEPS + 1))
  say "compose-check: $STEP ok ($(elapsed "$STEP_T0") s)${DETAIL:+: $DETAIL}"
}

cleanup() {
  local rc=$?
  trap - ERR
  set +e
  [ -z "$LOAD_PID" ] || kill "$LOAD_PID" 2>/dev/null
  [ -z "$MIRROR_PID" ] || kill "$MIRROR_PID" 2>/dev/null
  if [ "$rc" != 0 ]; then
    say "compose-check: $STEP FAILED ($(elapsed "$STEP_T0") s): $(cat "$WORK/failure" 2>/dev/null || echo "exit $rc")"
    if [ -n "$CLUSTER_UP" ]; then
      printf 'compose-check: the services, and the last lines of their logs:\n' >&3
      dc_all ps 2>&1 | sed 's/^/  /' >&3
      dc_all logs --no-color --tail 15 2>&1 | sed 's/^/  /' >&3
    fi
    printf 'compose-check: full output in %s\n' "$LOG" >&3
  fi
  if [ "${KEEP:-}" = 1 ]; then
    say "compose-check: KEEP=1: cluster $PROJECT and the daemon${DOCKERD_PID:+ (pid $DOCKERD_PID)} left running"
  else
    if [ -n "$CLUSTER_UP" ]; then
      DC_TIMEOUT=180 dc_all down -v --remove-orphans --timeout 10 >/dev/null 2>&1
    fi
    if [ -n "$DOCKERD_PID" ]; then
      kill "$DOCKERD_PID" 2>/dev/null
      for _ in $(seq 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
      kill -9 "$DOCKERD_PID" 2>/dev/null
      wait "$DOCKERD_PID" 2>/dev/null
      say "compose-check: dockerd (pid $DOCKERD_PID) stopped"
    fi
  fi
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT

# -- helpers -----------------------------------------------------------------------------------

probe() {  # probe NAME ARGS...: run scripts/compose_probe.py; its line becomes DETAIL or the failure
  local out
  out=$("$PY" scripts/compose_probe.py "$@" --key "$KEY" --http "$HTTP" --grpc "$GRPC" 2>>"$LOG") \
    || fail "${out#FAIL: }"
  echo "$out"
  DETAIL=$out
}

compose_up() {  # compose_up WHAT ARGS...: dc ARGS; on failure, compose's own error line
  local what=$1 out
  shift
  out=$(dc "$@" 2>&1) || { echo "$out"; fail "$what: $(grep -m1 -E 'ERROR|rror' <<<"$out" || tail -1 <<<"$out")"; }
  echo "$out"
}

wait_healthy() {  # wait_healthy [TIMEOUT_S]
  local out
  out=$(deploy/compose-wait.sh "$PROJECT" "${1:-300}" 2>&1) || fail "$(printf '%s\n' "$out" | head -1)"
}

container() {  # container SERVICE [INDEX]: the id of the service's container (its INDEX-th, from 1)
  local id
  id=$(dc ps -q "$1" | sed -n "${2:-1}p")
  [ -n "$id" ] || fail "no container for service $1"
  echo "$id"
}

redis_cli() {  # redis_cli ARGS...: redis-cli in the redis container, authenticated
  docker exec "$(container redis)" sh -c 'REDISCLI_AUTH="$(cat /secrets/redis-password)" exec redis-cli "$@"' \
    redis-cli "$@"
}

# Admission bookings (pdrouter/state/keys.py: <ns>:{pool}:kv:book:<worker>:<epoch>, one hash field a booking).
LUA_BOOKINGS="local n = 0 local c = '0' repeat local r = redis.call('SCAN', c, 'MATCH', '*:kv:book:*', 'COUNT', 1000)
c = r[1] for _, k in ipairs(r[2]) do n = n + redis.call('HLEN', k) end until c == '0' return n"
# Registered workers: worker ids with a record in a pool's workers hash and a live heartbeat key.
LUA_LIVE_WORKERS="local out = {} local c = '0' repeat local r = redis.call('SCAN', c, 'MATCH', '*:workers', 'COUNT', 1000)
c = r[1] for _, k in ipairs(r[2]) do local tag = string.sub(k, 1, -9) for _, id in ipairs(redis.call('HKEYS', k)) do
if redis.call('EXISTS', tag .. ':hb:' .. id) == 1 then table.insert(out, id) end end end until c == '0' return out"
# Prefix-index entries per worker incarnation: '<worker>:<epoch> <members>' for every px set.
LUA_PREFIX_SETS="local out = {} local c = '0' repeat local r = redis.call('SCAN', c, 'MATCH', '*:px:*', 'COUNT', 1000)
c = r[1] for _, k in ipairs(r[2]) do table.insert(out, string.match(k, ':px:(.*)$') .. ' ' .. redis.call('SCARD', k)) end
until c == '0' return out"

# Every prefix-index entry: '<worker>:<epoch> <block hash>', one a line.
LUA_PREFIX_ENTRIES="local out = {} local c = '0' repeat local r = redis.call('SCAN', c, 'MATCH', '*:px:*', 'COUNT', 1000)
c = r[1] for _, k in ipairs(r[2]) do local w = string.match(k, ':px:(.*)$') for _, m in ipairs(redis.call('SMEMBERS', k))
do table.insert(out, w .. ' ' .. m) end end until c == '0' return out"

bookings() { redis_cli EVAL "$LUA_BOOKINGS" 0; }
prefix_entries() { redis_cli EVAL "$LUA_PREFIX_ENTRIES" 0 | LC_ALL=C sort -u; }
live_workers() { redis_cli EVAL "$LUA_LIVE_WORKERS" 0 | sort; }
prefix_sets() { redis_cli EVAL "$LUA_PREFIX_SETS" 0 | sort; }

no_bookings_left() {  # poll until no booking is left (routers give unused credit back after 1 s idle)
  local n=""
  for _ in $(seq 40); do
    n=$(bookings)
    [ "$n" = 0 ] && { echo 0; return 0; }
    sleep 0.5
  done
  fail "$n admission bookings left in Redis 20 s after the load ended"
}

wait_workers() {  # wait_workers PREFILL DECODE [COLOCATED]: until that many live workers are registered
  local want_p=$1 want_d=$2 want_w=${3:-0} ids p d w
  for _ in $(seq 120); do
    ids=$(live_workers)
    p=$(grep -c '^prefill-' <<<"$ids" || true)
    d=$(grep -c '^decode-' <<<"$ids" || true)
    w=$(grep -c '^worker-' <<<"$ids" || true)
    if [ "$p" = "$want_p" ] && [ "$d" = "$want_d" ] && [ "$w" = "$want_w" ]; then return 0; fi
    sleep 0.5
  done
  fail "registry holds $p prefill, $d decode, $w colocated live workers; expected $want_p, $want_d, $want_w"
}

free_ports() { python3 -c 'import socket
socks = [socket.socket() for _ in range(4)]
for s in socks: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))'; }

# -- steps -------------------------------------------------------------------------------------

step_tools() {
  [ "$(id -u)" = 0 ] || fail "run as root: it installs packages and starts dockerd"
  local need=()
  command -v dockerd >/dev/null || need+=(docker.io)
  if [ "${COMPOSE_CMD[0]}" = docker-compose ] && ! command -v docker-compose >/dev/null; then need+=(docker-compose); fi
  command -v debootstrap >/dev/null || need+=(debootstrap)
  command -v curl >/dev/null || need+=(curl)
  command -v python3 >/dev/null || need+=(python3)
  if [ "${#need[@]}" -gt 0 ]; then
    apt-get update -q || fail "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" \
      || fail "apt-get install ${need[*]} failed"
  fi
  "$PY" -c 'import openai, grpc, httpx, pdrouter.wire.v1.router_pb2_grpc' \
    || fail "$PY lacks the dev extra (openai, grpc, pdrouter): run scripts/test.sh first, or set PYTHON"
  DETAIL="${need[*]:+installed ${need[*]}; }${COMPOSE_CMD[*]} $("${COMPOSE_CMD[@]}" version --short 2>/dev/null \
    | head -1), dockerd $(dockerd --version | sed 's/^Docker version \([^,]*\).*/\1/'), $(docker --version | cut -d, -f1 | sed 's/^Docker version/docker CLI/')"
}

step_daemon() {
  if docker info >/dev/null 2>&1; then
    DETAIL="using the daemon already running"
    return 0
  fi
  mkdir -p "${DOCKER_DATA_ROOT:-/var/lib/docker}"
  dockerd --data-root "${DOCKER_DATA_ROOT:-/var/lib/docker}" --pidfile "$WORK/dockerd.pid" \
    >"$WORK/dockerd.log" 2>&1 &
  DOCKERD_PID=$!
  for _ in $(seq 120); do
    docker info >/dev/null 2>&1 && break
    kill -0 "$DOCKERD_PID" 2>/dev/null || fail "dockerd exited: $(tail -3 "$WORK/dockerd.log" | tr '\n' ' ')"
    sleep 0.5
  done
  docker info >/dev/null 2>&1 || fail "dockerd did not answer within 60 s: $(tail -3 "$WORK/dockerd.log" | tr '\n' ' ')"
  DETAIL="dockerd pid $DOCKERD_PID, data root ${DOCKER_DATA_ROOT:-/var/lib/docker}, $(docker info -f '{{.Driver}}') storage"
}

pullable() { docker image inspect "$1" >/dev/null 2>&1 || timeout 120 docker pull -q "$1" >/dev/null 2>&1; }

step_base_images() {
  local base=${BASE_IMAGE:-python:3.11-slim} redis=${REDIS_IMAGE:-redis:7.4-alpine} notes=() standins
  if ! pullable "$base" || ! pullable "$redis"; then
    local cached=yes
    docker image inspect pdrouter-standin/python:3.11-slim pdrouter-standin/redis:7 >/dev/null 2>&1 || cached=no
    standins=$(scripts/compose_standin_images.sh) || fail "building the stand-in base images failed (see $LOG)"
    pullable "$base" || { notes+=("$base not pullable"); base=$(sed -n 's/^BASE_IMAGE=//p' <<<"$standins"); }
    pullable "$redis" || { notes+=("$redis not pullable"); redis=$(sed -n 's/^REDIS_IMAGE=//p' <<<"$standins"); }
    if [ "$cached" = yes ]; then notes+=("stand-ins cached"); else notes+=("stand-ins built by debootstrap"); fi
  fi
  BASE=$base
  REDIS=$redis
  DETAIL="base $BASE, redis $REDIS${notes[*]:+ ($(join ';' "${notes[@]}" | sed 's/;/; /g'))}"
}

step_image() {
  local ctx="$WORK/context" args=() torch_index
  # The build context: what /.dockerignore lets through, plus the host's CA bundle in build-extra/.
  mkdir -p "$ctx"
  cp .dockerignore "$ctx/"
  sed -n 's/^!//p' .dockerignore | while read -r path; do
    mkdir -p "$ctx/$(dirname "$path")"
    cp -a "$path" "$ctx/$path"
  done
  mkdir -p "$ctx/deploy"
  cp deploy/Dockerfile "$ctx/deploy/Dockerfile"
  # A fixed port: the build arguments name it, and they are part of the layer cache's key.
  python3 scripts/compose_pip_mirror.py --out "$WORK/pip-args" --port "${COMPOSE_CHECK_MIRROR_PORT:-47613}" &
  MIRROR_PID=$!
  for _ in $(seq 50); do [ -f "$WORK/pip-args" ] && break; sleep 0.1; done
  [ -f "$WORK/pip-args" ] || fail "scripts/compose_pip_mirror.py wrote no build arguments"
  while IFS= read -r line; do
    case $line in
      CA_BUNDLE=*) cp "${line#CA_BUNDLE=}" "$ctx/deploy/build-extra/host-ca.crt" ;;
      *) args+=(--build-arg "$line") ;;
    esac
  done <"$WORK/pip-args"
  if [ -n "${TORCH_INDEX_URL+set}" ]; then
    torch_index=$TORCH_INDEX_URL
  elif curl -fsS -o /dev/null --max-time 15 https://download.pytorch.org/whl/cpu/torch/ 2>/dev/null; then
    torch_index=https://download.pytorch.org/whl/cpu
  else
    torch_index=""
  fi
  local out
  out=$(DOCKER_BUILDKIT=0 timeout 1800 docker build --network host -f "$ctx/deploy/Dockerfile" -t "$IMAGE" \
        --build-arg "BASE_IMAGE=$BASE" --build-arg "TORCH_INDEX_URL=$torch_index" \
        ${EXTRA_PACKAGES:+--build-arg "EXTRA_PACKAGES=$EXTRA_PACKAGES"} "${args[@]}" "$ctx" 2>&1) \
    || { echo "$out"; fail "docker build failed: $(grep -v '^ *$' <<<"$out" | tail -1)"; }
  echo "$out"
  kill "$MIRROR_PID" 2>/dev/null || true
  wait "$MIRROR_PID" 2>/dev/null || true
  MIRROR_PID=""
  local cached fresh
  cached=$(grep -c 'Using cache' <<<"$out" || true)
  fresh=$(grep -c '^ ---> Running in' <<<"$out" || true)
  # The image's router runs compiled (the Dockerfile's MYPYC, "router" by default): how many modules.
  local compiled
  compiled=$(docker run --rm --entrypoint python "$IMAGE" -c \
             'from pdrouter.core.build import compiled_modules; print(compiled_modules())') \
    || fail "the image could not count its compiled modules (pdrouter.core.build)"
  [ "$compiled" -gt 0 ] || fail "the image runs the router's sources: nothing compiled (the Dockerfile's MYPYC)"
  local host_pip
  host_pip=$(sed -e 's/=.*//' -e 's/^CA_BUNDLE$/the CA bundle/' "$WORK/pip-args" | paste -sd, - | sed 's/,/, /g')
  DETAIL="$IMAGE ($(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.2f GB", $1/1e9}'), \
$fresh steps run, $cached cached; $compiled modules compiled; torch from ${torch_index:-the configured indexes}; from the host: ${host_pip:-nothing})"
}

step_up() {
  read -r HTTP_PORT GRPC_PORT CO_HTTP_PORT CO_GRPC_PORT < <(free_ports)
  export PDROUTER_IMAGE=$IMAGE PDROUTER_REDIS_IMAGE=$REDIS PDROUTER_HTTP_PORT=$HTTP_PORT \
    PDROUTER_GRPC_PORT=$GRPC_PORT PDROUTER_COLOCATED_HTTP_PORT=$CO_HTTP_PORT PDROUTER_COLOCATED_GRPC_PORT=$CO_GRPC_PORT
  HTTP="http://127.0.0.1:$HTTP_PORT"
  GRPC="127.0.0.1:$GRPC_PORT"
  DC_TIMEOUT=180 dc_all down -v --remove-orphans --timeout 5 || true  # what a failed run left
  CLUSTER_UP=yes
  compose_up "up -d" up -d --no-build
  wait_healthy 300
  KEY=$(dc exec -T router cat /secrets/api-keys | head -1 | tr -d '\r')
  [ -n "$KEY" ] || fail "no API key in the router's /secrets/api-keys"
  wait_workers 1 1
  DETAIL="$(dc ps -q | wc -l) containers, the long-running ones healthy; router on $HTTP and $GRPC"
}

step_completion() { probe completion; }
step_chat_stream() { probe chat-stream; }
step_models() { probe models; }
step_grpc() { probe grpc; }
step_metrics() { probe metrics; }

step_kill_prefill() {
  local cid pid restarts before out stop="$WORK/load-stop" t_kill back
  cid=$(container prefill)
  restarts=$(docker inspect -f '{{.RestartCount}}' "$cid")
  "$PY" scripts/compose_probe.py load --key "$KEY" --http "$HTTP" --stop-file "$stop" --concurrency 4 \
    --max-tokens 24 --timeout 60 >"$WORK/load.out" 2>>"$LOG" &
  LOAD_PID=$!
  sleep 4
  before=$(bookings)
  # A crash, as the OOM killer would do it: SIGKILL to the container's process. (`docker kill` is a
  # manual stop for Docker, which a restart policy then leaves stopped.)
  pid=$(docker inspect -f '{{.State.Pid}}' "$cid")
  [ "$pid" -gt 0 ] || fail "prefill container is not running"
  t_kill=$(date +%s.%N)
  kill -9 "$pid"
  for _ in $(seq 120); do
    [ "$(docker inspect -f '{{.RestartCount}}' "$cid")" -gt "$restarts" ] && break
    sleep 0.5
  done
  [ "$(docker inspect -f '{{.RestartCount}}' "$cid")" -gt "$restarts" ] || fail "prefill was not restarted"
  wait_healthy 180
  wait_workers 1 1
  back=$(elapsed "$t_kill")
  sleep 5  # served again once it is back
  touch "$stop"
  wait "$LOAD_PID" || { LOAD_PID=""; fail "load: $(sed 's/^FAIL: //' "$WORK/load.out")"; }
  LOAD_PID=""
  out=$(cat "$WORK/load.out")
  DETAIL="SIGKILL with $before admission bookings held, back and healthy in $back s (restart policy); \
load: $out; leaked bookings $(no_bookings_left)"
}

with_prefix_sets() {  # the live workers with a non-empty prefix set, one a line
  local sets id
  sets=$(prefix_sets)
  for id in $(live_workers); do
    awk -v w="$id" 'index($1, w ":") == 1 && $2 > 0 { found = 1 } END { exit !found }' <<<"$sets" && echo "$id"
  done
}

step_restart_redis() {
  local before after t0 out back
  before=$(with_prefix_sets | wc -l)
  [ "$before" -gt 0 ] || fail "no worker has published a prefix set before the restart"
  t0=$(date +%s.%N)
  dc restart redis
  wait_healthy 120
  wait_workers 1 1
  back=$(elapsed "$t0")
  for _ in $(seq 60); do
    after=$(with_prefix_sets | wc -l)
    [ "$after" -ge "$before" ] && break
    sleep 0.5
  done
  [ "$after" -ge "$before" ] || fail "$after workers republished their prefix sets, $before had them before"
  out=$("$PY" scripts/compose_probe.py served --key "$KEY" --http "$HTTP" --count 8 --first 2000 --retry-s 60) \
    || fail "after the restart: ${out#FAIL: }"
  DETAIL="workers re-registered in $back s, prefix sets republished by $after of $before, $out; \
leaked bookings $(no_bookings_left)"
}

kv_received() {  # '<decode worker> <KV bytes received>' lines, from the router's /metrics
  local out
  out=$("$PY" scripts/compose_probe.py kv-received --key "$KEY" --http "$HTTP") || fail "${out#FAIL: }"
  printf '%s\n' "$out"
}

step_scale() {
  local out id n grown=() idle=() sent=0 batch
  compose_up "up --scale prefill=2 --scale decode=2" up -d --no-build --scale prefill=2 --scale decode=2
  wait_healthy 300
  wait_workers 2 2
  prefix_entries >"$WORK/px-before"
  sleep 2  # a heartbeat of every decode worker since it registered
  kv_received >"$WORK/kv-before"
  # A prefill worker that computes a prompt caches its blocks and publishes them to the prefix index:
  # new entries under its id are requests that landed there (about 10 blocks a prompt; counted as new
  # hashes, since a full pool evicts as many as it adds). A decode worker publishes nothing; the KV
  # bytes it received (its heartbeats, in the router's /metrics) grow with the requests it took.
  # Routers book decode KV ahead in chunks (--admission-credit), so a few requests may all go to one
  # decode worker: send batches until every worker got some.
  for batch in 1 2 3 4 5 6 7 8; do
    out=$("$PY" scripts/compose_probe.py served --key "$KEY" --http "$HTTP" --count 16 --concurrency 6 \
          --first $((3000 + sent)) --retry-s 30) || fail "with 2 + 2 workers: ${out#FAIL: }"
    sent=$((sent + 16))
    prefix_entries >"$WORK/px-after"
    sleep 2  # the decode workers' next heartbeats
    kv_received >"$WORK/kv-after"
    grown=()
    idle=()
    for id in $(live_workers); do
      case "$id" in
        decode-*)
          n=$(awk -v w="$id" '$1 == w { if (FILENAME == ARGV[1]) b = $2; else a = $2 } END { print a - b + 0 }' \
              "$WORK/kv-before" "$WORK/kv-after")
          if [ "$n" -gt 0 ]; then grown+=("$id +$((n / 1024)) KiB of KV"); else idle+=("$id"); fi ;;
        *)
          n=$(LC_ALL=C comm -13 "$WORK/px-before" "$WORK/px-after" | awk -v w="$id" 'index($1, w ":") == 1' | wc -l)
          if [ "$n" -ge 5 ]; then grown+=("$id +$n prefix blocks"); else idle+=("$id"); fi ;;
      esac
    done
    [ "${#idle[@]}" -gt 0 ] || break
  done
  [ "${#idle[@]}" = 0 ] || fail "after $sent requests none landed on ${idle[*]} (${grown[*]:-none grew})"
  DETAIL="$sent of $sent served in $batch batch(es); per worker: $(join , "${grown[@]}" \
| sed 's/,/, /g'); leaked bookings $(no_bookings_left)"
}

step_colocated() {
  local out
  compose_up "--profile colocated up" --profile colocated up -d --no-build --scale prefill=2 --scale decode=2
  wait_healthy 300
  wait_workers 2 2 1
  out=$("$PY" scripts/compose_probe.py completion --key "$KEY" --http "http://127.0.0.1:$CO_HTTP_PORT") \
    || fail "colocated router: ${out#FAIL: }"
  local served
  served=$("$PY" scripts/compose_probe.py served --key "$KEY" --http "http://127.0.0.1:$CO_HTTP_PORT" \
           --count 8 --first 4000 --retry-s 30) || fail "colocated router: ${served#FAIL: }"
  DETAIL="router-colocated on 127.0.0.1:$CO_HTTP_PORT: $out; $served"
}

step_down() {
  dc_all down -v --remove-orphans --timeout 10 || fail "down -v failed"
  local containers volumes networks
  containers=$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT" | wc -l)
  volumes=$(docker volume ls -q --filter "label=com.docker.compose.project=$PROJECT" | wc -l)
  networks=$(docker network ls -q --filter "label=com.docker.compose.project=$PROJECT" | wc -l)
  [ "$containers$volumes$networks" = 000 ] \
    || fail "left after down -v: $containers containers, $volumes volumes, $networks networks"
  CLUSTER_UP=""
  DETAIL="no container, volume or network of $PROJECT left (docker ps -a: $(docker ps -aq | wc -l) containers in all)"
}

step tools step_tools
step daemon step_daemon
step "base images" step_base_images
step image step_image
step up step_up
step completion step_completion
step "chat stream" step_chat_stream
step models step_models
step "grpc generate" step_grpc
step metrics step_metrics
step "kill prefill under load" step_kill_prefill
step "restart redis" step_restart_redis
step "scale 2+2" step_scale
step "colocated profile" step_colocated
step "down -v" step_down
say "compose-check: all $STEPS steps ok in $(elapsed "$T0") s"
