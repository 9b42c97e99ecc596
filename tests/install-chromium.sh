#!/bin/sh
# What the report's browser test (tests/distribute/test_report.py) needs of the system: Debian's
# Chromium, headless. Installed with apt-get when missing and this is root on a Debian-like
# machine; otherwise (not root, no apt-get, apt-get failing) it says so and exits 0, so that
# `make test` goes on and the browser test, a promise, fails naming what is missing.
# Idempotent: with Chromium installed it changes nothing.
set -u
PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:$PATH"
export PATH

say() { echo "install-chromium.sh: $*" >&2; }

command -v chromium >/dev/null 2>&1 && exit 0
if [ "$(id -u)" != 0 ]; then
    say "not root: not installing chromium (the report's browser test needs it)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    say "no apt-get here: install Chromium by hand (the report's browser test needs it)"
    exit 0
fi
apt_install() {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        -o DPkg::Lock::Timeout=120 chromium >/dev/null
}
say "installing chromium"
# A stale package list: updated once, and tried again.
if ! apt_install && ! { apt-get update -q -o DPkg::Lock::Timeout=120 >/dev/null && apt_install; }; then
    say "apt-get could not install chromium: the report's browser test will say so"
fi
exit 0
