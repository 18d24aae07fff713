# Mender client + mender-artifact: tests/ota/test_mender.py drives scripts/mender/edge-bundle through
# the real client in standalone mode (it skips, saying why, where they are absent).
command -v mender >/dev/null || want_package mender-client "the Mender tests"
command -v mender-artifact >/dev/null || want_package mender-artifact "the Mender tests"
