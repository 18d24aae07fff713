# promtool (tests/serve/test_metrics.py's `promtool check metrics`, tests/fleet/test_rules.py's `promtool check
# rules` / `promtool test rules`) and the prometheus binary (tests/test_fleet_agent.py: agent mode
# remote-writing to a receiver). Debian ships both in the `prometheus` package (about 96 MB
# installed, no recommends pulled in; 2.42 on Debian 12). On a machine where systemd runs, Debian's
# package enables its own prometheus.service (port 9090): the tests do not use it.
if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
  want_package prometheus "the promtool and Prometheus agent tests"
fi
