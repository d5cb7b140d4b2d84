"""The node cache and the store against a real S3 server (moto's server mode on 127.0.0.1, the
real multi-storage-client / boto3 stack talking HTTP to it), with requests counted on the server.

The bytes every reader gets are compared with the bytes uploaded; request counts come from the
server's side, not from the client's own bookkeeping.
"""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_slmoe.storage.config import StorageConfig
from megatron_slmoe.storage import Storage, StorageError
from megatron_slmoe.storage.cache import NodeCache
from megatron_slmoe.storage.errors import CacheError, ObjectNotFoundError
from megatron_slmoe.storage.preflight import check_readable, preflight_store
from megatron_slmoe.storage.transfer import OutputMirror, download_tree, upload_tree
from megatron_slmoe.storage.urls import parse_url
from megatron_slmoe.utils.manifest import MANIFEST
from tests.helpers.entry_point import stand_in_base
from tests.helpers.s3_server import S3TestServer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def s3_server():
    with S3TestServer() as server:
        yield server


@pytest.fixture
def bucket(s3_server, monkeypatch, request):
    """A fresh bucket, and this process's environment pointed at the server."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    name = "t-" + request.node.name.lower().replace("_", "-")[:50].strip("-")
    s3_server.client().create_bucket(Bucket=name)
    s3_server.reset_counts()
    s3_server.throttle(None)
    return name


def _put(server, bucket, objects: dict[str, bytes]) -> None:
    client = server.client()
    for key, data in objects.items():
        client.put_object(Bucket=bucket, Key=key, Body=data)


def _objects(count: int, size: int, prefix: str = "shards/") -> dict[str, bytes]:
    return {f"{prefix}{i:03d}.bin": os.urandom(size + i) for i in range(count)}


def _storage(cache_dir, **settings) -> Storage:
    settings.setdefault("retry_timeout_seconds", 60.0)
    return Storage(StorageConfig(cache_dir=str(cache_dir), **settings))


def _worker(spec: dict, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.helpers.storage_worker", json.dumps(spec)],
                            cwd=REPO, env={**os.environ, **env, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- one download per node ------------------------------------------------------------------------


def test_two_ranks_on_a_node_download_each_object_once(s3_server, bucket, tmp_path):
    objects = _objects(6, 64 * 1024)
    _put(s3_server, bucket, objects)
    s3_server.reset_counts()
    urls = [f"s3://{bucket}/{key}" for key in objects]
    spec = {"cache_dir": str(tmp_path / "nvme"), "urls": urls, "start_at": time.time() + 2.0}
    ranks = [_worker(spec, {**s3_server.env(), "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(2)]
    results = []
    for proc in ranks:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))

    for key, data in objects.items():
        assert s3_server.requests("GET", f"/{bucket}/{key}") == 1, key
        for result in results:
            assert result["sha256"][f"s3://{bucket}/{key}"] == _sha(data)
    downloads = [r["stats"]["downloads"] for r in results]
    assert sum(downloads) == len(objects)  # split between the ranks, whoever came first
    assert sum(r["stats"]["hits"] for r in results) == len(objects)


# --- warm restarts, changed objects, damaged entries -----------------------------------------------


def test_warm_cache_is_reused_across_restarts_and_a_changed_object_is_fetched_again(
        s3_server, bucket, tmp_path):
    objects = _objects(3, 10_000)
    _put(s3_server, bucket, objects)
    urls = [f"s3://{bucket}/{key}" for key in objects]
    first = _storage(tmp_path, cache_revalidate_seconds=0)
    paths = first.local_files(urls)
    assert [Path(p).read_bytes() for p in paths] == list(objects.values())
    s3_server.reset_counts()

    # A restart (a new process's cache object) with a check on every open: HEADs, no GETs.
    restarted = _storage(tmp_path, cache_revalidate_seconds=0)
    assert restarted.local_files(urls) == paths
    assert s3_server.requests("GET") == 0 and s3_server.requests("HEAD") == len(urls)
    assert restarted.cache.stats.revalidations == len(urls)

    # Within the revalidation window another process trusts the node's check: no request at all.
    s3_server.reset_counts()
    assert _storage(tmp_path, cache_revalidate_seconds=3600).local_files(urls) == paths
    assert s3_server.requests() == 0

    # The object changes on the store (same size): the next check sees the ETag and refetches.
    key = next(iter(objects))
    changed = os.urandom(len(objects[key]))
    _put(s3_server, bucket, {key: changed})
    s3_server.reset_counts()
    path = _storage(tmp_path, cache_revalidate_seconds=0).local_file(f"s3://{bucket}/{key}")
    assert Path(path).read_bytes() == changed
    assert s3_server.requests("GET", f"/{bucket}/{key}") == 1


def test_damaged_entry_is_never_used(s3_server, bucket, tmp_path):
    key, data = "one.bin", os.urandom(50_000)
    _put(s3_server, bucket, {key: data})
    url = f"s3://{bucket}/{key}"
    path = Path(_storage(tmp_path).local_file(url))
    os.chmod(path, 0o644)
    path.write_bytes(data[:1000])  # truncated behind the cache's back
    s3_server.reset_counts()
    assert Path(_storage(tmp_path).local_file(url)).read_bytes() == data
    assert s3_server.requests("GET", f"/{bucket}/{key}") == 1


def test_msc_profile_urls_read_through_the_same_cache(s3_server, bucket, tmp_path, monkeypatch):
    """msc://PROFILE/PATH with the profile in MSC_CONFIG (credentials by ${VAR} expansion, as the
    README shows); a secret written into the profile file itself is masked in messages too."""
    data = os.urandom(20_000)
    _put(s3_server, bucket, {"d/x.bin": data})
    inline_secret = "inline-secret-in-profile-file"
    (tmp_path / "msc.yaml").write_text(f"""
profiles:
  store:
    storage_provider:
      type: s3
      options: {{base_path: {bucket}, endpoint_url: "{s3_server.endpoint}", region_name: us-east-1}}
    credentials_provider:
      type: S3Credentials
      options: {{access_key: "${{MY_KEY_ID}}", secret_key: "${{MY_KEY}}"}}
  broken:
    storage_provider:
      type: s3
      options: {{base_path: {bucket}, endpoint_url: "{s3_server.endpoint}", region_name: us-east-1}}
    credentials_provider:
      type: S3Credentials
      options: {{access_key: AKIAINLINEKEY0000000, secret_key: {inline_secret}}}
""")
    monkeypatch.setenv("MSC_CONFIG", str(tmp_path / "msc.yaml"))
    monkeypatch.setenv("MY_KEY_ID", s3_server.access_key_id)
    monkeypatch.setenv("MY_KEY", s3_server.secret_access_key)
    storage = _storage(tmp_path / "nvme")
    assert Path(storage.local_file("msc://store/d/x.bin")).read_bytes() == data
    assert s3_server.requests("GET", f"/{bucket}/d/x.bin") == 1
    with pytest.raises(StorageError, match="no profile 'nope'"):
        storage.local_file("msc://nope/d/x.bin")
    with pytest.raises(StorageError) as info:
        check_readable(preflight_store(storage.config, storage.store),
                       parse_url("msc://broken/d/x.bin"))
    assert "msc://broken/d/x.bin" in str(info.value) and "access denied" in str(info.value)
    from megatron_slmoe.utils.redact import redact

    assert inline_secret not in redact(f"something about {inline_secret}")


def test_data_settings_resolve_to_local_files_in_key_order(s3_server, bucket, tmp_path):
    """What training/tasks/text.py asks of a data setting: an object, a prefix of JSONL shards,
    an indexed-dataset prefix (its .idx and .bin) or a prefix of several; what the trainer asks
    of --base-checkpoint / --adapter-init: a directory; local paths pass."""
    objects = {"jsonl/b.jsonl": b"b\n", "jsonl/a.jsonl": b"a\n", "jsonl/notes.txt": b"-",
               "ds/y.idx": os.urandom(100), "ds/y.bin": os.urandom(3000),
               "ds/x.idx": os.urandom(90), "ds/x.bin": os.urandom(2000),
               "ckpt/common.pt": os.urandom(500), "ckpt/model/__0_0.distcp": os.urandom(700)}
    _put(s3_server, bucket, objects)
    storage = _storage(tmp_path / "nvme")
    root = f"s3://{bucket}"

    def read(path):
        return Path(path).read_bytes()

    assert [read(p) for p in storage.local_shards(f"{root}/jsonl/", ".jsonl")] == [b"a\n", b"b\n"]
    assert [read(p) for p in storage.local_shards(f"{root}/jsonl/b.jsonl", ".jsonl")] == [b"b\n"]
    assert storage.local_shards("/local/x.jsonl", ".jsonl") == ["/local/x.jsonl"]
    prefixes = storage.local_indexed_datasets(f"{root}/ds/")
    assert [Path(p).name for p in prefixes] == ["x", "y"]
    for prefix, name in zip(prefixes, "xy"):
        for suffix in (".idx", ".bin"):
            assert read(prefix + suffix) == objects[f"ds/{name}{suffix}"]
    assert storage.local_indexed_datasets(f"{root}/ds/y") == [prefixes[1]]
    assert storage.local_indexed_datasets("/local/corpus") == ["/local/corpus"]
    directory = Path(storage.local_dir(f"{root}/ckpt"))
    assert sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()) \
        == ["common.pt", "model/__0_0.distcp"]
    for rel in ("common.pt", "model/__0_0.distcp"):
        assert read(directory / rel) == objects[f"ckpt/{rel}"]
    assert storage.local_dir("/local/ckpt") == "/local/ckpt"
    for key in objects:
        assert s3_server.requests("GET", f"/{bucket}/{key}") == (0 if key.endswith(".txt") else 1)
    with pytest.raises(ObjectNotFoundError, match="no '\\*.jsonl' objects"):
        storage.local_shards(f"{root}/ds/", ".jsonl")


# --- size bound -----------------------------------------------------------------------------------


def test_cache_stays_within_its_bound_evicting_least_recently_used(s3_server, bucket, tmp_path):
    size = 100_000
    objects = {f"lru/{name}.bin": os.urandom(size) for name in "abcd"}
    _put(s3_server, bucket, objects)
    url = {name: f"s3://{bucket}/lru/{name}.bin" for name in "abcd"}
    cache = _storage(tmp_path, cache_max_gb=3.5 * size / 2**30, cache_revalidate_seconds=3600).cache
    for name in "abc":
        cache.fetch(url[name])
        time.sleep(0.05)  # distinct last-use times
    cache.fetch(url["a"])  # a is now the most recently used; b the least
    cache.fetch(url["d"])
    assert cache.used_bytes() <= cache.max_bytes
    present = {name for name in "abcd" if os.path.exists(cache.local_path(url[name]))}
    assert present == {"a", "c", "d"}
    assert cache.stats.evictions == 1
    with pytest.raises(CacheError, match="--cache-max-gb"):
        _storage(tmp_path / "small", cache_max_gb=size / 2 / 2**30).local_file(url["a"])


# --- faults ---------------------------------------------------------------------------------------


def test_reads_survive_the_server_going_down_mid_transfer(s3_server, bucket, tmp_path):
    objects = _objects(5, 200_000)
    _put(s3_server, bucket, objects)
    keys = list(objects)
    s3_server.reset_counts()
    s3_server.outage_on("GET", f"/{bucket}/{keys[2]}", seconds=3.0)
    storage = _storage(tmp_path / "nvme", prefetch_shards=1, retry_backoff_seconds=0.2)
    started = time.monotonic()
    with storage.prefetcher([f"s3://{bucket}/{k}" for k in keys]) as shards:
        got = [Path(path).read_bytes() for path in shards]
    assert got == list(objects.values())
    assert s3_server.outages == 1 and time.monotonic() - started >= 3.0
    assert s3_server.requests("GET", f"/{bucket}/{keys[2]}") == 2  # cut off once, then complete


def test_kill_during_download_leaves_nothing_trusted(s3_server, bucket, tmp_path):
    key, data = "big.bin", os.urandom(2 * 1024 * 1024)
    _put(s3_server, bucket, {key: data})
    url = f"s3://{bucket}/{key}"
    cache_dir = tmp_path / "nvme"
    s3_server.throttle(512 * 1024, path_contains=key)  # ~4 s for the whole object
    proc = _worker({"cache_dir": str(cache_dir), "urls": [url]}, s3_server.env())
    partial = None
    deadline = time.time() + 60
    while time.time() < deadline and partial is None:  # kill once the body is flowing
        if s3_server.get_bytes(f"/{bucket}/{key}") > 0:
            partial = next((cache_dir / "tmp").glob("*.part"), None)
        time.sleep(0.05)
    assert partial is not None, "the download never started"
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert s3_server.get_bytes(f"/{bucket}/{key}") < len(data)  # killed mid-transfer
    s3_server.throttle(None)

    cache = NodeCache(_storage(cache_dir).store, str(cache_dir), 1 << 30)
    assert not os.path.exists(cache.local_path(url))  # nothing in place, let alone trusted
    assert partial.exists()  # the orphan is there until the next reservation cleans it up
    s3_server.reset_counts()
    assert Path(cache.fetch(url)).read_bytes() == data
    assert s3_server.requests("GET", f"/{bucket}/{key}") == 1
    assert not partial.exists()


# --- start-up checks ------------------------------------------------------------------------------


def _validate_only(capsys, *flags, base: Path) -> tuple[int, str]:
    """The entry point's pre-launch check (as the launcher runs it before torchrun) of a LoRA run
    on a (stand-in) base."""
    import torch

    from megatron_slmoe.training.finetune import main

    initialised = torch.distributed.is_initialized()
    code = main(["--validate-only", "--storage-preflight-timeout", "1",
                 "--base-checkpoint", str(stand_in_base(base)), *flags])
    assert torch.distributed.is_initialized() == initialised  # no process group was formed
    return code, capsys.readouterr().err


def test_start_up_check_names_the_flag_and_url_in_one_line_without_secrets(
        s3_server, bucket, monkeypatch, capsys, tmp_path):
    # One good instruction record: the start-up check reads stored instruction files too.
    _put(s3_server, bucket, {"data/train.jsonl": b'{"prompt": "a", "response": "b"}\n'})
    good = f"s3://{bucket}/data/train.jsonl"
    secret = s3_server.secret_access_key

    def validate(*flags):  # held-out data is needed with --train-data; a later flag overrides it
        return _validate_only(capsys, "--valid-data", good, *flags, base=tmp_path / "base")

    assert validate("--train-data", good, "--valid-data", f"s3://{bucket}/data/",
                    "--output-url", f"s3://{bucket}/runs/x") == (0, "")

    cases = [
        ({"AWS_SECRET_ACCESS_KEY": "not-the-secret-0123"}, "--train-data", good,
         "SignatureDoesNotMatch"),
        ({"AWS_ACCESS_KEY_ID": "AKIANOSUCHKEY0000000"}, "--train-data", good, "InvalidAccessKeyId"),
        ({}, "--train-data", "s3://no-such-bucket-x/data/train.jsonl",
         "bucket 'no-such-bucket-x' does not exist"),
        ({}, "--valid-data", f"s3://{bucket}/data/missing.jsonl", "no such object"),
        ({}, "--adapter-init", f"s3://{bucket}/adapters/none/", "no objects under this prefix"),
        ({}, "--output-url", "s3://no-such-bucket-y/run", "bucket"),
        ({"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}, "--tokenizer", good,
         "cannot connect to http://127.0.0.1:9"),
    ]
    for env, flag, url, reason in cases:
        with monkeypatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)
            code, err = validate(flag, url)
        assert code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"error: {flag}: ") and url in err and reason in err, err
        assert secret not in err and s3_server.access_key_id not in err
        assert "not-the-secret-0123" not in err

    with monkeypatch.context() as patch:  # installed without the s3 extra
        patch.setitem(sys.modules, "multistorageclient", None)
        code, err = validate("--train-data", good)
    assert (code, err) == (2, f"error: --train-data: {good}: object storage needs "
                              "multi-storage-client and boto3: pip install 'megatron-slmoe[s3]'\n")


# --- outputs --------------------------------------------------------------------------------------


def _checkpoint(root: Path, iteration: int) -> Path:
    """A directory shaped like training/checkpointing.py's, with its manifest."""
    from megatron_slmoe.utils.manifest import inventory

    directory = root / f"iter_{iteration:07d}"
    (directory / "dist").mkdir(parents=True)
    (directory / "dist" / "shard_0.distcp").write_bytes(os.urandom(30_000))
    (directory / "trainer_state.json").write_text(json.dumps({"iteration": iteration}))
    (directory / MANIFEST).write_text(json.dumps({"iteration": iteration,
                                                  "files": inventory(str(directory))}))
    return directory


def test_outputs_reach_the_store_complete_or_not_at_all(s3_server, bucket, tmp_path):
    storage = _storage(tmp_path / "nvme")
    mirror = storage.output_mirror(f"s3://{bucket}/run", keep_last=2)
    local = tmp_path / "checkpoints"
    for iteration in (5, 10, 15):
        mirror.submit_checkpoint(str(_checkpoint(local, iteration)))
    mirror.wait()
    latest = storage.store.get_bytes(parse_url(f"s3://{bucket}/run/checkpoints/latest"))
    assert latest == b"iter_0000015"
    assert mirror.stored_checkpoints() == ["iter_0000010", "iter_0000015"]  # keep_last=2

    # The manifest went up after every file it lists, and latest after the manifest.
    puts = [path for method, path in s3_server.log if method == "PUT" and "iter_0000015" in path
            or path.endswith("/latest") and method == "PUT"]
    assert puts[-2].endswith(f"iter_0000015/{MANIFEST}") and puts[-1].endswith("/latest")

    # Resume elsewhere: the newest stored checkpoint comes back byte for byte.
    restored = mirror.restore_checkpoint(str(tmp_path / "elsewhere"), local_newest=None)
    for path in (local / "iter_0000015").rglob("*"):
        if path.is_file():
            twin = Path(restored) / path.relative_to(local / "iter_0000015")
            assert twin.read_bytes() == path.read_bytes()
    assert mirror.restore_checkpoint(str(tmp_path / "x"), local_newest="iter_0000015") is None

    # A damaged stored checkpoint is skipped for the previous one.
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key="run/checkpoints/iter_0000015/dist/shard_0.distcp",
                      Body=b"garbage")
    restored = mirror.restore_checkpoint(str(tmp_path / "third"), local_newest=None)
    assert restored.endswith("iter_0000010")
    assert not (tmp_path / "third" / "iter_0000015").exists()

    # A directory without its manifest (an upload cut short) is refused, never half-used.
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(os.urandom(5000))
    (adapter / "adapter_config.json").write_text("{}")
    upload_tree(storage.store, str(adapter), parse_url(f"s3://{bucket}/run/adapter/"))
    client.delete_object(Bucket=bucket, Key=f"run/adapter/{MANIFEST}")
    with pytest.raises(ObjectNotFoundError, match="incomplete"):
        download_tree(storage.store, parse_url(f"s3://{bucket}/run/adapter/"), str(tmp_path / "a2"))


def test_upload_failure_is_raised_not_swallowed(s3_server, bucket, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-for-upload")
    mirror = OutputMirror(_storage(tmp_path).store, parse_url(f"s3://{bucket}/run"), keep_last=1)
    mirror.submit_checkpoint(str(_checkpoint(tmp_path / "checkpoints", 1)))
    with pytest.raises(StorageError, match="access denied") as info:
        mirror.wait()
    assert "wrong-secret-for-upload" not in str(info.value)
