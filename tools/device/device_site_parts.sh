#!/usr/bin/env bash
# The device tool sends the working tree plus carried paths, at most 64 MiB a command. The SGLang site
# archives of ../shared/device/build-site.sh are 37-39 MB each, so they fit next to a tree of up to ~28 MB
# only; with both quality models shipped (~30 MB) they no longer do. This cuts them into byte ranges of
# at most PART_MB (default 24) that travel one per command and are joined again on the GPU machine.
#
#   bash tools/device/device_site_parts.sh split        # here, once: .device-site/site*.tar.xz -> .device-site/parts/
#   bash tools/device/device_site_parts.sh bootstrap    # there, in each command that carries a part:
#                                                     # keeps the part in /root/parts, unpacks every archive
#                                                     # whose parts have all arrived into /root/site
#
# Carry one file of .device-site/parts per command (plus .device-site/models in the one that runs
# servers); `bootstrap` prints what is complete. Then: export PYTHONPATH=/root/site:$PWD.
set -euo pipefail

case "${1:-}" in
split)
  size_mb="${PART_MB:-24}"
  rm -rf .device-site/parts && mkdir -p .device-site/parts
  for a in .device-site/site*.tar.xz; do
    name=$(basename "$a")
    split -b "${size_mb}M" -d -a 1 "$a" ".device-site/parts/$name.part"
    n=$(ls .device-site/parts/"$name".part* | wc -l)
    for p in .device-site/parts/"$name".part*; do mv "$p" "${p%.part*}.$((10#${p##*.part} + 1))-of-$n"; done
  done
  ls -la .device-site/parts
  ;;
bootstrap)
  mkdir -p /root/parts /root/site
  for p in .device-site/parts/*-of-*; do [ -e "$p" ] && cp -n "$p" /root/parts/; done
  for first in /root/parts/*.1-of-*; do
    [ -e "$first" ] || continue
    base=${first%.1-of-*}; n=${first##*-of-}; name=$(basename "$base")
    [ -e "/root/site/.$name.done" ] && continue
    have=$(ls "$base".*-of-"$n" | wc -l)
    [ "$have" = "$n" ] || { echo "$name: $have of $n parts"; continue; }
    for i in $(seq 1 "$n"); do cat "$base.$i-of-$n"; done | tar xJf - -C /root/site
    touch "/root/site/.$name.done" && echo "unpacked $name"
  done
  (ls /root/site/.site*.done 2>/dev/null || true) | sed 's#.*/\.##; s#\.done##' | tr '\n' ' '
  echo "present in /root/site"
  ;;
*)
  echo "usage: $0 split|bootstrap" >&2; exit 2 ;;
esac
