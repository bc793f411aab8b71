#!/bin/sh
# Wait until a compose project's containers are all up: every long-running one healthy (running,
# for one without a health check) and every one-shot step exited 0. Compose v1 and v2 alike (it
# reads the com.docker.compose.project label both put on their containers), so it stands in for
# v2's `up --wait`, which v1 does not have:
#
#   docker-compose -p pd-router -f deploy/docker-compose.yml up -d && deploy/compose-wait.sh pd-router
#
# Usage: compose-wait.sh PROJECT [TIMEOUT_S]   (default 300 s; DOCKER: the docker command)
# Exit 0 when ready; 1, with one line per container, when one is unhealthy, a one-shot failed, or
# the time ran out.
set -eu

project=${1:?usage: compose-wait.sh PROJECT [TIMEOUT_S]}
timeout_s=${2:-300}
docker=${DOCKER:-docker}
# Whole seconds: past the deadline means at least timeout_s have gone by, whatever the fraction of a
# second it started in.
deadline=$(( $(date +%s) + timeout_s ))

states() {
  ids=$($docker ps -aq --filter "label=com.docker.compose.project=$project") || return 1
  [ -n "$ids" ] || return 0
  # name status exit-code health restart-policy
  # shellcheck disable=SC2086
  $docker inspect -f '{{.Name}} {{.State.Status}} {{.State.ExitCode}} {{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}} {{.HostConfig.RestartPolicy.Name}}' $ids
}

while :; do
  if ! out=$(states); then
    # A container removed between ps and inspect, or no daemon: try again until the deadline.
    if [ "$(date +%s)" -gt "$deadline" ]; then
      echo "compose-wait: $project not ready: cannot list its containers ($docker ps / inspect failed)" >&2
      exit 1
    fi
    sleep 1
    continue
  fi
  verdict=ready
  problem=""
  if [ -z "$out" ]; then
    verdict=waiting
    problem="no containers for project $project"
  fi
  while read -r name status code health policy; do
    [ -n "$name" ] || continue
    name=${name#/}
    case "$status:$health" in
      running:healthy | running:none) ;;
      running:unhealthy) verdict=failed; problem="$name is unhealthy" ;;
      exited:*)
        if [ "$code" = 0 ] && { [ "$policy" = no ] || [ -z "$policy" ]; }; then :
        elif [ "$policy" = no ] || [ -z "$policy" ]; then verdict=failed; problem="$name exited $code"
        else [ "$verdict" = failed ] || verdict=waiting; problem="$name exited $code (restart policy $policy)"
        fi ;;
      *) [ "$verdict" = failed ] || verdict=waiting; problem="$name is $status${health:+ ($health)}" ;;
    esac
  done <<EOF
$out
EOF
  if [ "$verdict" = ready ]; then
    exit 0
  fi
  if [ "$verdict" = failed ] || [ "$(date +%s)" -gt "$deadline" ]; then
    [ "$verdict" = failed ] || problem="timed out after ${timeout_s} s: $problem"
    echo "compose-wait: $project not ready: $problem" >&2
    printf '%s\n' "$out" | sed 's/^\//  /' >&2
    exit 1
  fi
  sleep 1
done
