# Sourced by the launchers: make sure megatron_slmoe is importable, creating or reusing .venv.
#
# In an environment where the package is already installed (a cluster image, a user's own venv)
# nothing happens. Otherwise <repo>/.venv is created or reused and the project is installed into
# it with its native kernels; it is reinstalled when setup.py or csrc/ changed. Overrides:
#   PYTHON             interpreter that creates the venv (default: python3)
#   SLMOE_TORCH_SPEC   torch requirement (default: the CPU build torch==2.13.0 on machines
#                      without nvidia-smi; plain "torch" where an NVIDIA driver is present)
#   SLMOE_NO_VENV=1    never create a venv: fail if megatron_slmoe is not importable

slmoe_repo_root() { (cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd); }

_slmoe_importable() {
    python -c 'import importlib.util as u, sys; sys.exit(0 if u.find_spec("megatron_slmoe") and u.find_spec("megatron.core") else 1)' 2>/dev/null
}

_slmoe_build_inputs_sum() {
    cat "$1/setup.py" $(find "$1/csrc" -type f 2>/dev/null | sort) 2>/dev/null | cksum | cut -d' ' -f1
}

slmoe_ensure_env() {
    local root want
    root=$(slmoe_repo_root)
    if [ -z "${VIRTUAL_ENV:-}" ] && [ -x "$root/.venv/bin/python" ]; then
        . "$root/.venv/bin/activate"
    fi
    want=$(_slmoe_build_inputs_sum "$root")
    if [ "${VIRTUAL_ENV:-}" = "$root/.venv" ]; then
        if _slmoe_importable && [ "$(cat "$VIRTUAL_ENV/.slmoe-build-stamp" 2>/dev/null)" = "$want" ]; then
            return 0
        fi
    elif _slmoe_importable; then
        return 0  # someone else's environment that already has the package
    elif [ "${SLMOE_NO_VENV:-0}" = 1 ]; then
        echo "error: megatron_slmoe is not importable and SLMOE_NO_VENV=1" >&2
        return 2
    else
        echo "[env] creating virtual environment $root/.venv" >&2
        "${PYTHON:-python3}" -m venv "$root/.venv" || return 2
        . "$root/.venv/bin/activate"
    fi
    local torch_spec="${SLMOE_TORCH_SPEC:-}"
    if [ -z "$torch_spec" ]; then
        if command -v nvidia-smi >/dev/null 2>&1; then torch_spec="torch"; else torch_spec="torch==2.13.0"; fi
    fi
    echo "[env] installing $torch_spec, megatron-core and megatron_slmoe into $VIRTUAL_ENV" >&2
    python -m pip install -q --upgrade pip setuptools wheel ninja || return 2
    python -m pip install -q "$torch_spec" || return 2
    # No build isolation: the native kernels must compile against the torch installed above.
    (cd "$root" && MAX_JOBS="${MAX_JOBS:-2}" python -m pip install -q --no-build-isolation -e ".[test]") || return 2
    echo "$want" > "$VIRTUAL_ENV/.slmoe-build-stamp"
}
