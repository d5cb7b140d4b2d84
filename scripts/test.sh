#!/usr/bin/env bash
# Run the test suite (creating or reusing .venv first). Arguments go to pytest, e.g.
#   bash scripts/test.sh tests/unit -k platform
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/env.sh
slmoe_ensure_env
exec python -m pytest "$@"
