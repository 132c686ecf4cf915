#!/bin/bash
# Build or warm every test-host artefact: host packages, the trixie rootfs, guest
# images and virtqemud. Idempotent; takes a second or two when the cache is warm.
# TH_PRUNE=1 (default) removes cached artefacts of other recipes/versions.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

t0=$(th__now)
t=$t0; th_host_deps;          th_log "host deps:  $(th__since "$t")"
t=$(th__now); rootfs=$(th_rootfs);    th_log "rootfs:     $(th__since "$t")  $rootfs"
t=$(th__now); guest=$(th_guest);      th_log "guest:      $(th__since "$t")  $guest (ACPI power button: $(cat "$guest/acpi-powerdown"))"
t=$(th__now); vq=$(th_virtqemud);     th_log "virtqemud:  $(th__since "$t")  $vq"

if [[ ${TH_PRUNE:-1} == 1 ]]; then
  keep=("$rootfs" "$guest" "$(dirname "$vq")")
  for d in "$TH_CACHE"/rootfs-* "$TH_CACHE"/guest-* "$TH_CACHE"/virtqemud-*; do
    [[ -d $d ]] || continue
    [[ " ${keep[*]} " == *" $d "* ]] && continue
    if th__in_use "$d"; then th_log "keeping old artefact $d: in use"; continue; fi
    th_log "pruning old artefact $d"
    rm -rf "$d" "$TH_CACHE/.log/$(basename "$d").log" "$TH_CACHE/.lock/$(basename "$d")"
  done
fi
th_log "prepare done in $(th__since "$t0")"
