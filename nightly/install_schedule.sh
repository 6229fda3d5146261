#!/usr/bin/env bash
# Schedule `make nightly` on this machine (the GPU box), every night at a fixed time.
#   nightly/install_schedule.sh [--at HH:MM]            systemd timer + service (root: system units)
#   nightly/install_schedule.sh --cron [--at HH:MM]     a crontab line for the current user instead
#   nightly/install_schedule.sh --print [--cron]        show what would be installed, install nothing
# Check: systemctl list-timers labkit-nightly.timer; journalctl -u labkit-nightly; crontab -l
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
AT=02:00; MODE=systemd; PRINT=
while [ $# -gt 0 ]; do
  case "$1" in
    --at) AT=$2; shift 2 ;;
    --cron) MODE=cron; shift ;;
    --print) PRINT=1; shift ;;
    *) echo "usage: $0 [--cron] [--at HH:MM] [--print]" >&2; exit 2 ;;
  esac
done
[[ "$AT" =~ ^([01][0-9]|2[0-3]):[0-5][0-9]$ ]] || { echo "--at $AT: expected HH:MM" >&2; exit 2; }
HOUR=$((10#${AT%:*})); MIN=$((10#${AT#*:}))
fill() { sed -e "s|@REPO@|$REPO|g" -e "s|@USER@|$(id -un)|g" -e "s|@AT@|$AT|g" -e "s|@HOUR@|$HOUR|g" -e "s|@MIN@|$MIN|g" "$1"; }
deps() { echo "installing what the nightly plan needs: make venv vllm-venv"; make -C "$REPO" venv vllm-venv; }
if [ "$MODE" = cron ]; then
  line=$(fill "$REPO/nightly/crontab" | grep -v '^#')
  if [ -n "$PRINT" ]; then echo "$line"; exit 0; fi
  deps
  ( crontab -l 2>/dev/null | grep -v 'make nightly' || true; echo "$line" ) | crontab -
  echo "installed for $(id -un): $line"
  exit 0
fi
if [ -n "$PRINT" ]; then
  for u in service timer; do echo "# /etc/systemd/system/labkit-nightly.$u"; fill "$REPO/nightly/systemd/labkit-nightly.$u"; done
  exit 0
fi
[ "$(id -u)" = 0 ] || { echo "systemd system units need root (or use --cron)" >&2; exit 1; }
# what the plan needs, before the first night: the lab's .venv and vLLM's .venv-vllm (the serve and xfer
# entries; a night without it skips them with the reason in nightly.log)
deps
for u in service timer; do fill "$REPO/nightly/systemd/labkit-nightly.$u" > "/etc/systemd/system/labkit-nightly.$u"; done
systemctl daemon-reload
systemctl enable --now labkit-nightly.timer
systemctl list-timers labkit-nightly.timer --no-pager
