"""Object-storage pieces that need no server: credential redaction, URLs, settings, the retry loop.

Redaction is checked against the secret strings themselves (they must not appear) and against
ordinary text that looks similar (it must come back unchanged).
"""

import logging
import sys

import pytest

from megatron_slmoe.storage import parse_url
from megatron_slmoe.storage.errors import (
    AccessDeniedError,
    StorageConfigError,
    StorageTimeoutError,
    TransientStorageError,
)
from megatron_slmoe.utils.redact import (
    MASK,
    RedactingFilter,
    redact,
    redact_mapping,
    register_secret,
)
from megatron_slmoe.storage.retry import RetryPolicy, call_with_retry

SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzzSECRET1"
KEY_ID = "AKIAZZZZZZZZTESTKEY1"


@pytest.fixture
def aws_env(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)


# --- redaction -------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    f"could not sign with {SECRET}",
    f"key id {KEY_ID} refused",
    f"https://{KEY_ID}:{SECRET}@minio.local:9000/bucket",
    f"GET /b/k?X-Amz-Credential={KEY_ID}%2F20250101&X-Amz-Signature=0123456789abcdef&x=1",
    f"Authorization: AWS4-HMAC-SHA256 Credential={KEY_ID}/20250101/us-east-1/s3, Signature=abcd",
    "aws_secret_access_key = plainsecret123",
    '{"secret_key": "plainsecret123", "session_token": "tok-abcdef"}',
])
def test_redact_removes_every_credential(aws_env, text):
    cleaned = redact(text)
    for secret in (SECRET, KEY_ID, "plainsecret123", "0123456789abcdef", "tok-abcdef"):
        assert secret not in cleaned
    assert MASK in cleaned


@pytest.mark.parametrize("text", [
    "iteration 10 loss=2.345678 tokens_per_s=123456.7 lr=0.002",
    "eos_token: <|eos|> max_tokens=2048 tokenizer=/data/tokenizer.json",
    "s3://bucket/data/shard-00001.jsonl on http://127.0.0.1:9000",
    "TOKENIZERS_PARALLELISM=false",
])
def test_redact_leaves_ordinary_text_alone(aws_env, text):
    assert redact(text) == text


def test_registered_secret_and_mapping_dump(aws_env):
    register_secret("profile-file-secret-42")
    assert "profile-file-secret-42" not in redact("loaded profile-file-secret-42 from yaml")
    config = {"storage": {"endpoint_url": f"http://user:{SECRET}@h:9000",
                          "credentials": {"access_key": KEY_ID, "secret_key": "x" * 12},
                          "eos_token": "<|eos|>", "tokens": 5}}
    dumped = redact_mapping(config)
    text = repr(dumped)
    assert SECRET not in text and KEY_ID not in text and "x" * 12 not in text
    assert dumped["storage"]["eos_token"] == "<|eos|>" and dumped["storage"]["tokens"] == 5
    assert config["storage"]["credentials"]["secret_key"] == "x" * 12  # a copy, not in place


def test_log_filter_redacts_arguments_and_tracebacks(aws_env):
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(self.format(record))

    handler = Keep()
    handler.addFilter(RedactingFilter())
    logger = logging.getLogger("test_storage_redaction")
    logger.addHandler(handler)
    try:
        logger.warning("signing with %s", SECRET)
        try:
            raise RuntimeError(f"bad secret {SECRET}")
        except RuntimeError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    assert len(records) == 2 and all(SECRET not in r for r in records)
    assert "RuntimeError" in records[1]  # the traceback is kept, cleaned


def test_errors_are_one_line_without_secrets(aws_env):
    err = AccessDeniedError(f"s3://b/k: denied\nfor {SECRET}")
    assert "\n" not in str(err) and SECRET not in str(err) and "s3://b/k" in str(err)


# --- URLs -----------------------------------------------------------------------------------------


def test_urls_parse_and_join():
    url = parse_url("s3://my-bucket/data/train/")
    assert (url.scheme, url.authority, url.key, url.is_prefix) == ("s3", "my-bucket", "data/train/", True)
    shard = url.join("part-0001.jsonl")
    assert str(shard) == "s3://my-bucket/data/train/part-0001.jsonl" and not shard.is_prefix
    assert shard.relative_to(url) == "part-0001.jsonl"
    assert str(parse_url("msc://obs-profile/datasets/x.bin")) == "msc://obs-profile/datasets/x.bin"


@pytest.mark.parametrize("text, fragment", [
    ("s3://Bad_Bucket/x", "not a valid bucket name"),
    ("s3://b/x", "not a valid bucket name"),
    ("gs://bucket/x", "not an object-storage URL"),
    ("s3://bucket/a/../b", "'..'"),
    ("s3://bucket/a//b", "empty"),
])
def test_bad_urls_are_refused_in_one_line(text, fragment):
    with pytest.raises(StorageConfigError, match=fragment):
        parse_url(text)


def test_credentials_in_a_url_are_refused_without_echoing_them():
    with pytest.raises(StorageConfigError) as info:
        parse_url(f"s3://{KEY_ID}:{SECRET}@bucket/key")
    assert SECRET not in str(info.value) and KEY_ID not in str(info.value)


# --- settings -------------------------------------------------------------------------------------


def _parse(*argv):
    from megatron_slmoe.training.cli import parse_command_line

    return parse_command_line(list(argv), prog="t", description="", world_size=0).run


def test_settings_come_from_the_run_configuration(monkeypatch, tmp_path):
    from megatron_slmoe.storage import Storage

    monkeypatch.setenv("SLMOE_CACHE_DIR", str(tmp_path / "nvme"))
    run = _parse("--cache-max-gb", "2.5", "--prefetch-shards", "4",
                 "--output-url", "s3://bucket/run")
    assert (run.storage.prefetch_shards, run.output.output_url) == (4, "s3://bucket/run")
    assert run.storage.cache_dir is None  # the node's choice, resolved where the cache is made
    cache = Storage(run.storage).cache
    assert (cache.root, cache.max_bytes) == (str(tmp_path / "nvme"), int(2.5 * 2**30))
    assert Storage(_parse("--cache-dir", "/local/x").storage).cache_dir == "/local/x"


@pytest.mark.parametrize("argv, needle", [
    (["--cache-max-gb", "0"], "storage.cache_max_gb: --cache-max-gb must be positive"),
    (["--prefetch-shards", "-1"], "storage.prefetch_shards: --prefetch-shards must be >= 0"),
    (["--cache-dir", "s3://bucket/x"], "storage.cache_dir: --cache-dir s3://bucket/x must be a "
                                       "local path"),
    (["--output-url", "/local/dir"], "output.output_url: --output-url /local/dir: expected an "
                                     "s3:// or msc:// URL"),
    (["--output-dir", "s3://bucket/x"], "--output-dir s3://bucket/x must be a local path"),
    (["--train-data", "s3://Bad_Bucket/x"], "data.train_data: --train-data s3://Bad_Bucket/x: "
                                            "'Bad_Bucket' is not a valid bucket name"),
])
def test_bad_settings_are_one_line_naming_the_flag(argv, needle):
    from megatron_slmoe.config.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        _parse(*argv)
    assert needle in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("flag, key", [
    ("--train-data", "data.train_data"), ("--tokenizer", "data.tokenizer"),
    ("--base-checkpoint", "model.base_checkpoint"), ("--adapter-init", "model.adapter_init"),
    ("--output-url", "output.output_url")])
def test_credentials_in_a_url_setting_never_reach_the_config_or_the_error(aws_env, flag, key,
                                                                         capsys):
    """A URL with credentials in it is refused in one line naming the setting but not the secret
    (before --print-config prints anything); the dump of a configuration (``--print-config``, a
    run's config.yaml) masks the environment's secrets wherever they appear."""
    from megatron_slmoe.training.cli import to_yaml
    from megatron_slmoe.training.finetune import main

    for key_id, secret in ((KEY_ID, SECRET), ("someone", "plainsecret123")):
        url = f"s3://{key_id}:{secret}@bucket/key"
        assert main([flag, url, "--print-config"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.startswith(f"error: {key}: {flag} s3://{MASK}@bucket/key: "), err
        assert "credentials do not belong in the URL" in err and err.count("\n") == 1
        assert secret not in err and key_id not in err
    dumped = to_yaml(_parse("--output-dir", f"runs/{SECRET}"))
    assert SECRET not in dumped and f"runs/{MASK}" in dumped


# --- retries --------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self):
        self.now = 0.0
        self.sleeps = []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


def test_retry_stalls_through_transient_errors_then_succeeds():
    clock, failures = FakeClock(), iter(range(5))

    def flaky():
        if next(failures, None) is not None:
            raise TransientStorageError("GET s3://b/k: connection refused")
        return "bytes"

    policy = RetryPolicy(timeout_s=100.0, initial_backoff_s=1.0, max_backoff_s=4.0)
    assert call_with_retry(flaky, policy, "GET s3://b/k", clock, clock.sleep) == "bytes"
    assert len(clock.sleeps) == 5
    # exponential with jitter in [0.5, 1] of 1, 2, 4, 4, 4
    for got, ceiling in zip(clock.sleeps, [1, 2, 4, 4, 4]):
        assert ceiling * 0.5 <= got <= ceiling


def test_retry_gives_up_after_the_total_timeout_and_never_retries_permanent_errors():
    clock = FakeClock()

    def down():
        raise TransientStorageError("HEAD s3://b/k: cannot connect")

    with pytest.raises(StorageTimeoutError, match="--storage-retry-timeout 10"):
        call_with_retry(down, RetryPolicy(10.0, 1.0), "HEAD", clock, clock.sleep)
    assert 10.0 <= clock.now <= 10.0 + 1e-9  # the last sleep stops at the deadline

    calls = []

    def denied():
        calls.append(1)
        raise AccessDeniedError("s3://b/k: access denied")

    with pytest.raises(AccessDeniedError):
        call_with_retry(denied, RetryPolicy(10.0), "HEAD", clock, clock.sleep)
    assert len(calls) == 1


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
