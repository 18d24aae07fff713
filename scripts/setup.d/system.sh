# The system suite (tests/system/, marker `system`) boots a Debian rootfs built with mmdebstrap
# under systemd-nspawn and enters it with nsenter. Without root it is skipped, so only root asks
# for the packages.
if [ "$(id -u)" = 0 ]; then
  command -v systemd-nspawn >/dev/null || missing+=(systemd-container)
  command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
  command -v nsenter >/dev/null || missing+=(util-linux)
else
  echo "setup: not root: the system tests (tests/system) will be skipped" >&2
fi
