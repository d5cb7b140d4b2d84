"""The CPU adaptor must not break other libraries imported into the same process: after
`import megatron_slmoe`, transformers' modeling modules import (they use torch.cuda.Stream in
annotations), and torch.cuda.Stream/Event are still classes that construct and work on CPU."""

import os
import subprocess
import sys

_SCRIPT = """
import megatron_slmoe, torch
assert megatron_slmoe.PLATFORM.name == "cpu"
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
import transformers.models.deepseek_v3.modeling_deepseek_v3
import transformers.models.nemotron_h.modeling_nemotron_h
import transformers.models.llama.modeling_llama
stream = torch.cuda.Stream()
assert isinstance(stream, torch.cuda.Stream) and stream == torch.cuda.current_stream()
with torch.cuda.stream(stream):
    stream.wait_stream(torch.cuda.current_stream())
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record(); end.record()
assert isinstance(start, torch.cuda.Event) and start.elapsed_time(end) >= 0.0
print("ok")
"""


def test_transformers_modeling_modules_import_after_megatron_slmoe():
    env = {**os.environ, "SLMOE_PLATFORM": "cpu"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
