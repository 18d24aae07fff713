# Headless Chromium (tests/fleet/test_timeline.py): the SVG timeline is laid out by a real browser,
# which says where each text box is (getBBox, its own layout and fonts) and renders it to PNG:
# no label may leave the canvas or cover another. Debian's `chromium` (about 250 MB installed)
# runs headless without a display; DejaVu Sans Mono is the timeline's first font (its advance is
# what the layout counts with).
if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then
  want_package chromium "the timeline's browser check"
fi
[ -e /usr/share/fonts/truetype/dejavu/DejaVuSansMono.ttf ] || missing+=(fonts-dejavu-core)
