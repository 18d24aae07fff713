# Headless Chromium (tests/fleet/test_timeline.py): the SVG timeline is rendered to PNG by a real
# browser, and its text boxes are read back from the browser's own layout (getBBox) to check that
# no label leaves the canvas or covers another. Debian's `chromium` (about 250 MB installed) runs
# headless without a display; DejaVu Sans Mono is the timeline's first font (its advance width is
# what the layout counts with). Where no package is known, the test skips, saying why.
if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then
  _chromium_known() { local p; p="$(apt-cache policy chromium 2>/dev/null)"; [[ "$p" == *"Candidate: "[0-9]* ]]; }
  if ! _chromium_known && command -v apt-get >/dev/null && [ "${apt_updated:-0}" != 1 ]; then
    echo "setup: refreshing the apt lists to look for the Debian package chromium" >&2
    _sudo=""; [ "$(id -u)" = 0 ] || _sudo="sudo"
    $_sudo apt-get update -qq >/dev/null && apt_updated=1
  fi
  if _chromium_known; then
    missing+=(chromium)
  else
    echo "setup: no Debian package chromium here (after apt-get update): the timeline's browser" \
         "check will be skipped" >&2
  fi
fi
[ -e /usr/share/fonts/truetype/dejavu/DejaVuSansMono.ttf ] || missing+=(fonts-dejavu-core)
