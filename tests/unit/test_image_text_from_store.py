"""An energon image-text dataset read from an S3 prefix as it is read (a real S3 server: moto's
server mode; GET requests counted on the server's side):

- opening it fetches the metadata and the tar indices, no shard;
- a sample fetches its shard, and the next shard the reader will need arrives in the background,
  each once; shards nobody reads are not fetched; the samples equal those of the same dataset
  read from a local folder; a data-parallel rank reads ahead in its own share of the batches;
- a cache too small for the dataset evicts shards and tar indices, which come back when read;
- a shard that is gone from the store, or replaced by another size, during the run is a storage
  error naming it (not a damaged shard, which would end the run as bad data);
- a shard truncated on the store is refused at open, from the listing, without downloading it.
"""

import os

import pytest
import torch

from megatron_slmoe.data.errors import DataError
from megatron_slmoe.data.image import ImagePreprocessConfig
from megatron_slmoe.data.image_inputs import TiledImages
from megatron_slmoe.data.image_text import ImageTextDataset
from megatron_slmoe.data.sampler import RankReads
from megatron_slmoe.data.shapes import ensure_shapes_task
from megatron_slmoe.data.assets import asset_path
from megatron_slmoe.data.tokenizer import load_tokenizer
from megatron_slmoe.storage import Storage
from megatron_slmoe.storage.config import StorageConfig
from megatron_slmoe.storage.errors import ObjectChangedError, ObjectNotFoundError
from megatron_slmoe.training.reliability.failures import failure_that_repeats
from megatron_slmoe.data.image_text import node_view
from tests.helpers.s3_server import S3TestServer

BUCKET = "image-text"
IMAGES = TiledImages(ImagePreprocessConfig(img_h=16, img_w=16), -200, 4)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shapes")
    ensure_shapes_task(str(folder / "s"))
    return folder / "s" / "vqa"


@pytest.fixture(scope="module")
def server(shapes):
    with S3TestServer() as server:
        server.client().create_bucket(Bucket=BUCKET)
        server.upload_folder(BUCKET, "vqa/", shapes)
        yield server


@pytest.fixture
def storage(server, monkeypatch, tmp_path):
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    server.reset_counts()
    return Storage(StorageConfig(cache_dir=str(tmp_path / "nvme"), retry_timeout_seconds=30.0))


def _upload(server, shapes, prefix: str) -> str:
    server.upload_folder(BUCKET, prefix, shapes)
    return f"s3://{BUCKET}/{prefix}"


def _gets(server, shapes) -> dict[str, int]:
    return {str(p.relative_to(shapes)): server.requests("GET", f"/{BUCKET}/vqa/"
                                                         f"{p.relative_to(shapes)}")
            for p in shapes.rglob("*") if p.is_file()}


def _dataset(path, **kw):
    return ImageTextDataset(str(path), load_tokenizer(asset_path("tokenizer.json")), 64,
                            images=IMAGES, shuffle=False, **kw)


def test_shards_arrive_as_they_are_read(server, shapes, storage):
    local, stored = node_view(storage, f"s3://{BUCKET}/vqa/")
    gets = _gets(server, shapes)
    assert all(n == 1 for name, n in gets.items() if not name.endswith(".tar")), gets
    assert not any(n for name, n in gets.items() if name.endswith(".tar")), gets

    dataset = _dataset(local, stored=stored)  # opening reads the first usable sample
    reference = _dataset(shapes)
    # Shards of 1000 samples: the first 40 samples need shard 0 alone; samples 990-999 need
    # shard 0 too, and shard 1 is next within the read-ahead: fetched in the background.
    assert dataset._shard_of(999) != dataset._shard_of(1000)
    for i in [*range(40), *range(990, 1000)]:
        ours, theirs = dataset[i], reference[i]
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), i
    stored.close()  # the background downloads finish
    gets = _gets(server, shapes)
    fetched = {name for name, n in gets.items() if name.endswith(".tar") and n}
    assert fetched == {"train/shard-000000.tar", "train/shard-000001.tar"}, gets
    assert all(n <= 1 for n in gets.values()), gets  # each object once for the node


def test_read_ahead_follows_this_ranks_share_of_each_global_batch(server, shapes, storage):
    local, stored = node_view(storage, f"s3://{BUCKET}/vqa/")
    # Rank 0 of 2 with global batches of 2000 reads samples 0-999 and then 2000-2999: after
    # 990-999 (shard 0) its next samples are in shard 2; shard 1 is the other rank's.
    dataset = _dataset(local, stored=stored, reads=RankReads(2000, 0, 2))
    assert {dataset._shard_of(i) for i in range(2000, 2256)} == {"train/shard-000002.tar"}
    for i in range(990, 1000):
        dataset[i]
    stored.close()
    gets = _gets(server, shapes)
    fetched = {name for name, n in gets.items() if name.endswith(".tar") and n}
    assert fetched == {"train/shard-000000.tar", "train/shard-000002.tar"}, gets


def test_evicted_shards_and_indices_come_back(server, shapes, monkeypatch, tmp_path):
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    url = _upload(server, shapes, "small-cache/")
    shard = (shapes / "train" / "shard-000000.tar").stat().st_size
    storage = Storage(StorageConfig(cache_dir=str(tmp_path / "nvme"), retry_timeout_seconds=30.0,
                                    cache_max_gb=1.5 * shard / 2**30, prefetch_shards=0))
    server.reset_counts()
    local, stored = node_view(storage, url)
    dataset, reference = _dataset(local, stored=stored), _dataset(shapes)
    for i in (0, 1000, 2000, 0, 1500):
        ours, theirs = dataset[i], reference[i]
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), i
    first = f"/{BUCKET}/small-cache/train/shard-000000.tar"
    assert server.requests("GET", first) == 2  # evicted by shards 1 and 2, read again
    assert server.requests("GET", first + ".idx") >= 2  # the oldest entries go first


@pytest.mark.parametrize("change", ["deleted", "replaced"])
def test_a_shard_changed_on_the_store_during_the_run_is_a_storage_error(server, shapes, storage,
                                                                        change):
    url = _upload(server, shapes, f"{change}/")
    local, stored = node_view(storage, url)
    dataset = _dataset(local, stored=stored)
    key = f"{change}/train/shard-000001.tar"
    if change == "deleted":
        server.client().delete_object(Bucket=BUCKET, Key=key)
    else:
        server.client().put_object(Bucket=BUCKET, Key=key, Body=b"x" * 1024)
    error = ObjectNotFoundError if change == "deleted" else ObjectChangedError
    with pytest.raises(error) as err:
        dataset[1000]
    assert f"s3://{BUCKET}/{key}" in str(err.value) and "\n" not in str(err.value)
    assert local not in str(err.value)  # the URL the user gave, not the node cache's copy
    # A failure that repeats: the job ends in this line instead of being restarted.
    assert failure_that_repeats(err.value, "run") == str(err.value)


def test_a_truncated_shard_on_the_store_is_refused_without_downloading_it(server, shapes,
                                                                          storage):
    data = (shapes / "val" / "shard-000000.tar").read_bytes()
    client = server.client()
    prefix = "damaged/"
    for path in (p for p in shapes.rglob("*") if p.is_file()):
        name = str(path.relative_to(shapes))
        body = data[: len(data) // 2] if name == "val/shard-000000.tar" else path.read_bytes()
        client.put_object(Bucket=BUCKET, Key=prefix + name, Body=body)
    server.reset_counts()
    local, stored = node_view(storage, f"s3://{BUCKET}/{prefix}")
    with pytest.raises(DataError) as err:
        _dataset(local, stored=stored, split="val")
    assert str(err.value).startswith(f"s3://{BUCKET}/damaged: shard val/shard-000000.tar is "
                                     f"truncated")
    assert server.requests("GET", f"/{BUCKET}/{prefix}val/shard-000000.tar") == 0
    assert not os.path.exists(os.path.join(local, "val", "shard-000000.tar"))
