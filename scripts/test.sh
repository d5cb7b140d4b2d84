#!/usr/bin/env bash
# Run the test suite (creating or reusing .venv first). Arguments go to pytest, e.g.
#   bash scripts/test.sh tests/unit -k platform
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/env.sh
slmoe_ensure_env
# Every rank, launcher check and tool a test starts imports this package: compile it once here,
# or each of those processes compiles it again where bytecode is not written
# (PYTHONDONTWRITEBYTECODE=1; Python still reads .pyc files that exist and are current). A file
# that does not compile is pytest's to report.
python -m compileall -q megatron_slmoe tests tools >/dev/null || true
exec python -m pytest "$@"
