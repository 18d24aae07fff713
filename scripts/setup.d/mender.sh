# Mender client + mender-artifact: tests/ota/test_mender.py drives scripts/mender/edge-bundle through
# the real client in standalone mode (it skips, saying why, where they are absent).
command -v mender >/dev/null || missing+=(mender-client)
command -v mender-artifact >/dev/null || missing+=(mender-artifact)
