#!/usr/bin/env bash
# Debian's chromium for the page's browser tests (tests/ui), which drive it through Playwright;
# Playwright's own browser download is never used. Run by `make test` only: serving needs no
# browser. A no-op once chromium is there.
set -euo pipefail
if [[ -x /usr/bin/chromium ]]; then
  exit 0
fi
printf '\n==> %s\n' "installing chromium for the browser tests (apt-get)" >&2
SUDO=(); [[ $(id -u) -eq 0 ]] || SUDO=(sudo)
"${SUDO[@]}" apt-get update -q
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium
