"""The fine-tuning job on 2 real ranks (torchrun, gloo) with its data, tokenizer and outputs on an
S3 server (moto's server mode on 127.0.0.1; requests counted on the server side):

- run A reads sharded training data, held-out data and the tokenizer from the store, each object
  downloaded once for the node (not once per rank), and writes its checkpoints, adapter, config,
  metrics and summary back (the adapter on the store is byte for byte the local one; no secret in
  the config or the summary);
- the store's newest checkpoint is then made incomplete (its manifest removed, as an upload cut
  short leaves it); run B, on a fresh local directory and a cold cache, resumes from the newest
  *complete* stored checkpoint while the server goes down for a few seconds in the middle of its
  checkpoint upload, and reproduces run A's losses exactly.

The start-up check of the URLs (a wrong secret, a missing bucket or key, an unreachable endpoint:
one line, exit code 2, before any process group forms) is tested in tests/unit/test_storage_cache.py.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.entry_point import losses as _losses
from tests.helpers.s3_server import S3TestServer

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "megatron_slmoe" / "assets"
BUCKET = "finetune-store"
COMMON = ["--model-config", "tiny", "--seq-length", "64", "--global-batch-size", "8",
          "--micro-batch-size", "2", "--lr", "1e-3", "--lr-warmup-iters", "1", "--eval-iters", "1",
          "--eval-interval", "1000", "--log-interval", "1", "--lora-rank", "4", "--fp32",
          "--no-tensorboard", "--train-iters", "4", "--save-interval", "2",
          "--train-data", f"s3://{BUCKET}/data/train/",
          "--valid-data", f"s3://{BUCKET}/data/eval.jsonl",
          "--tokenizer", f"s3://{BUCKET}/tokenizer/tokenizer.json",
          "--base-checkpoint", f"s3://{BUCKET}/base/",
          "--output-url", f"s3://{BUCKET}/runs/lora", "--storage-retry-backoff", "0.2"]
DATA_KEYS = ["data/train/part-000.jsonl", "data/train/part-001.jsonl", "data/eval.jsonl",
             "tokenizer/tokenizer.json"]


@pytest.fixture(scope="module")
def server(tiny_base):
    with S3TestServer() as server:
        client = server.client()
        client.create_bucket(Bucket=BUCKET)
        server.upload_folder(BUCKET, "base/", tiny_base)  # LoRA adapts a trained base
        lines = (ASSETS / "digits_train.jsonl").read_text().splitlines(keepends=True)
        half = len(lines) // 2
        for key, body in [(DATA_KEYS[0], "".join(lines[:half])), (DATA_KEYS[1], "".join(lines[half:])),
                          (DATA_KEYS[2], (ASSETS / "digits_eval.jsonl").read_text()),
                          (DATA_KEYS[3], (ASSETS / "tokenizer.json").read_text())]:
            client.put_object(Bucket=BUCKET, Key=key, Body=body.encode())
        yield server


def _finetune(server, args):
    """The job as users start it: torchrun, 2 ranks on this node."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "megatron_slmoe.training.finetune", *args]
    return subprocess.run(cmd, cwd=REPO, env={**os.environ, **server.env(), "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=600)


def _stored(server, key: str) -> bytes:
    return server.client().get_object(Bucket=BUCKET, Key=key)["Body"].read()


def test_run_reads_from_and_writes_to_the_store_then_resumes_from_it(server, tmp_path):
    run_a = tmp_path / "a"
    server.reset_counts()
    proc = _finetune(server, [*COMMON, "--output-dir", str(run_a),
                              "--cache-dir", str(tmp_path / "nvme-a")])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for key in DATA_KEYS:  # two ranks, one node: one download each
        assert server.requests("GET", f"/{BUCKET}/{key}") == 1, key
    assert _stored(server, "runs/lora/checkpoints/latest") == b"iter_0000004"
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert _stored(server, f"runs/lora/adapter/{name}") == (run_a / "adapter" / name).read_bytes()
    pictures = json.loads((run_a / "summary.json").read_text())["plots"]
    assert pictures and all(_stored(server, f"runs/lora/plots/{os.path.basename(p)}")
                            == Path(p).read_bytes() for p in pictures)
    stored_summary = _stored(server, "runs/lora/summary.json")
    assert stored_summary == (run_a / "summary.json").read_bytes()
    assert json.loads(stored_summary)["output_url"] == f"s3://{BUCKET}/runs/lora"
    stored_config = _stored(server, "runs/lora/config.yaml")
    assert stored_config == (run_a / "config.yaml").read_bytes()
    assert yaml.safe_load(stored_config)["data"]["train_data"] == f"s3://{BUCKET}/data/train/"
    for secret in (server.secret_access_key, server.access_key_id):
        assert secret.encode() not in stored_summary + stored_config, secret
        assert secret not in proc.stdout + proc.stderr
    losses_a = _losses(run_a)
    assert sorted(losses_a) == [1, 2, 3, 4]

    # The newest stored checkpoint loses its manifest (an upload cut short): not to be used.
    server.client().delete_object(Bucket=BUCKET, Key="runs/lora/checkpoints/iter_0000004/MANIFEST.json")
    run_b = tmp_path / "b"
    server.reset_counts()
    server.outage_on("PUT", "checkpoints/iter_0000004/", seconds=3.0)
    proc = _finetune(server, [*COMMON, "--output-dir", str(run_b),
                              "--cache-dir", str(tmp_path / "nvme-b")])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "restored checkpoint iter_0000002" in out and "resumed from" in out
    assert server.outages == 1  # the server did go down mid-upload
    losses_b = _losses(run_b)
    assert sorted(losses_b) == [3, 4]
    for it in (3, 4):
        assert losses_b[it] == pytest.approx(losses_a[it], rel=1e-6, abs=1e-7), f"iteration {it}"
    assert _stored(server, "runs/lora/checkpoints/latest") == b"iter_0000004"
    _stored(server, "runs/lora/checkpoints/iter_0000004/MANIFEST.json")  # complete again
    assert server.secret_access_key not in out



def test_image_text_dataset_from_the_store(server, tmp_path, monkeypatch, capsys):
    """An energon image-text dataset under an s3:// prefix: its metadata reaches the node once for
    two ranks (the start-up check and the run share the node cache), each shard once when it is
    read, and the run trains on it;
    a prefix that holds no energon dataset is one line, exit code 2, before start-up (what the
    launcher runs before torchrun)."""
    from megatron_slmoe.data.shapes import ensure_shapes_task

    folder = tmp_path / "shapes"
    ensure_shapes_task(str(folder))
    keys = server.upload_folder(BUCKET, "shapes/vqa/", folder / "vqa")
    assert any("/.nv-meta/" in k for k in keys) and any(k.endswith(".tar") for k in keys)
    common = ["--task", "image-text", "--finetune-mode", "full", "--eval-answers", "0",
              "--seq-length", "48", "--micro-batch-size", "2", "--global-batch-size", "4",
              "--train-iters", "2", "--lr-warmup-iters", "1", "--eval-iters", "1",
              "--eval-interval", "1000", "--fp32", "--no-tensorboard",
              "--storage-retry-backoff", "0.2", "--cache-dir", str(tmp_path / "nvme")]
    server.reset_counts()
    proc = _finetune(server, [*common, "--train-data", f"s3://{BUCKET}/shapes/vqa/",
                              "--output-dir", str(tmp_path / "run")])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for key in keys:  # the metadata at start-up, a shard when read: each once for the node
        gets = server.requests("GET", f"/{BUCKET}/{key}")
        assert gets == 1 if not key.endswith(".tar") else gets <= 1, key
    assert server.requests("GET", f"/{BUCKET}/shapes/vqa/val/shard-000000.tar") == 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["task"] == "image-text"
    assert summary["shard_wait_s"] >= 0  # the shards were read as streamed
    assert summary["eval_loss_after"] < summary["eval_loss_before"]

    from megatron_slmoe.training.finetune import main

    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    assert main([*common, "--train-data", f"s3://{BUCKET}/data/", "--output-dir",
                 str(tmp_path / "bad"), "--validate-only"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: --train-data s3://{BUCKET}/data/: not an energon dataset (no .nv-meta/ under "
        f"the prefix; prepare one with tools/prepare_image_text.py and upload the folder)"]
    assert not (tmp_path / "bad").exists()
