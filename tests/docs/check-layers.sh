#!/bin/sh
# make check: layers never call back up (tests/docs/check_layers.py says
# exactly what counts; check-links.sh runs it and reports).
# Usage: tests/docs/check-layers.sh BUILD_DIR
exec "$(dirname "$0")/check-links.sh" "$1" layers
