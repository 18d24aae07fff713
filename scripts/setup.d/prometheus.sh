# promtool, for tests/test_metrics.py's `promtool check metrics` lint of /metrics. Debian ships it
# in the `prometheus` package (about 96 MB installed, no recommends pulled in); where the package is
# not available the lint test skips and says why.
if ! command -v promtool >/dev/null; then
  if apt-cache policy prometheus 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    missing+=(prometheus)
  else
    echo "setup: no Debian package prometheus here: the promtool lint test will be skipped" >&2
  fi
fi
