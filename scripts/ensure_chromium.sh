#!/usr/bin/env bash
# Debian's Chromium for the real-browser tests (Playwright drives it; nothing is downloaded by Playwright),
# installed where this machine allows it: root with apt-get. It never fails the caller: without Chromium
# the browser tests skip and the last line of `make test` says so and how to run them.
# LABKIT_NO_APT=1 skips the install; LABKIT_CHROMIUM names the binary the tests use (default /usr/bin/chromium).
CHROMIUM=${LABKIT_CHROMIUM:-/usr/bin/chromium}
[ -x "$CHROMIUM" ] && exit 0
if [ -n "${LABKIT_NO_APT:-}" ]; then
  echo "chromium: $CHROMIUM absent and LABKIT_NO_APT is set; the browser tests will be skipped"
elif [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "chromium: installing Debian's chromium for the browser tests (apt-get; LABKIT_NO_APT=1 skips this)"
  if ! (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/tmp/labkit-apt-chromium.log 2>&1; then
    echo "chromium: could not install it (log: /tmp/labkit-apt-chromium.log); the browser tests will be skipped"
  fi
else
  echo "chromium: $CHROMIUM absent and not installable here (needs root and apt-get); the browser tests will be skipped"
fi
exit 0
