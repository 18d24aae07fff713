# promtool (tests/serve/test_metrics.py's `promtool check metrics`, tests/fleet/test_rules.py's `promtool check
# rules` / `promtool test rules`) and the prometheus binary (tests/test_fleet_agent.py: agent mode
# remote-writing to a receiver). Debian ships both in the `prometheus` package (about 96 MB
# installed, no recommends pulled in; 2.42 on Debian 12). On a machine where systemd runs, Debian's
# package enables its own prometheus.service (port 9090): the tests do not use it.
#
# A fresh machine (a CI image, a container) has empty apt lists: `apt-cache policy` knows no
# candidate until `apt-get update` ran. So the lists are refreshed here first when the package is
# unknown, and `apt_updated=1` tells scripts/setup not to update a second time. Only where the
# package is still unknown after that (not Debian/Ubuntu, no network) are the tests skipped.
if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
  # (output captured first: under `set -o pipefail` an early `grep -q` exit fails the pipeline)
  _prometheus_known() { local p; p="$(apt-cache policy prometheus 2>/dev/null)"; [[ "$p" == *"Candidate: "[0-9]* ]]; }
  if ! _prometheus_known && command -v apt-get >/dev/null && [ "${apt_updated:-0}" != 1 ]; then
    echo "setup: refreshing the apt lists to look for the Debian package prometheus" >&2
    _sudo=""; [ "$(id -u)" = 0 ] || _sudo="sudo"
    $_sudo apt-get update -qq >/dev/null && apt_updated=1
  fi
  if _prometheus_known; then
    missing+=(prometheus)
  else
    echo "setup: no Debian package prometheus here (after apt-get update): the promtool and" \
         "Prometheus agent tests will be skipped" >&2
  fi
fi
