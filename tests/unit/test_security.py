"""Security hygiene: nothing the package loads is unpickled unless it is weights-only (a checkpoint
from elsewhere cannot run code), and credentials in the environment are not printed by the
launcher. (Output files not being world-writable, and no secret reaching a run's files or log,
are checked on a real run in tests/distributed/test_finetune.py.)"""

from __future__ import annotations

import ast
import os
import subprocess
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node, ast.unparse(node.func)


def test_no_unpickling_in_the_package_or_tools():
    problems = []
    for path in [*(REPO / "megatron_slmoe").rglob("*.py"), *(REPO / "tools").rglob("*.py")]:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                if any(n.split(".")[0] in ("pickle", "dill", "cloudpickle", "marshal")
                       for n in names):
                    problems.append(f"{path}:{node.lineno}: imports an unpickler")
        for call, name in _calls(tree):
            where = f"{path.relative_to(REPO)}:{call.lineno}"
            if name.endswith("torch.load") or name == "load" and "torch" in ast.unparse(call):
                safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant)
                           and k.value.value is True for k in call.keywords)
                if not safe:
                    problems.append(f"{where}: torch.load without weights_only=True")
            if name in ("yaml.load", "yaml.unsafe_load", "yaml.full_load"):
                loader = {k.arg: ast.unparse(k.value) for k in call.keywords}.get("Loader", "")
                if "Safe" not in loader and "UniqueKey" not in loader:
                    problems.append(f"{where}: {name} with loader {loader or 'default'}")
            if name in ("eval", "exec"):
                problems.append(f"{where}: {name}")
    assert problems == []


class _Trap:
    """Unpickling this would create a file: proof that code ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_dist_checkpoint_that_carries_code_is_refused(tmp_path):
    """Megatron's dist checkpoints load their common state with torch's weights-only unpickler
    (the default of this torch): a crafted common.pt does not run."""
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    marker = tmp_path / "pwned"
    torch.save({"x": _Trap(str(marker))}, tmp_path / "common.pt")
    try:
        TorchCommonLoadStrategy().load_common(str(tmp_path))
    except Exception as err:  # noqa: BLE001  (UnpicklingError, possibly wrapped)
        assert "weights_only" in str(err) or "Unpickl" in type(err).__name__ + str(err)
    else:
        raise AssertionError("the crafted common.pt was loaded")
    assert not marker.exists()


def test_the_launcher_does_not_print_credentials():
    secret = "s3cr3t-value-123"
    env = {**os.environ, "SLMOE_S3_SECRET_ACCESS_KEY": secret, "SLMOE_HF_TOKEN": secret,
           "NCCL_IB_PASSWORD_FILE_X": secret, "NCCL_SOCKET_IFNAME": "eth0"}
    out = subprocess.run(["bash", "-c", ". scripts/lib/launch.sh && slmoe_print_env"], cwd=REPO,
                         env=env, capture_output=True, text=True, check=True).stdout
    assert secret not in out
    assert "SLMOE_S3_SECRET_ACCESS_KEY=<hidden>" in out.splitlines()
    assert "NCCL_SOCKET_IFNAME=eth0" in out.splitlines()
