"""The image-text loader benchmark runs short and writes the rows it promises, its object-store
rows reading what the samples need through the cold cache (less than copying the whole prefix
first reads) and less again through the warm one (its figures are not asserted: timings do not
belong in tests)."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_image_text_loader_benchmark_writes_every_row(tmp_path):
    out = tmp_path / "loader.json"
    proc = subprocess.run(
        [sys.executable, "tools/bench/image_text_loader.py", "--samples", "8", "--repeats", "1",
         "--no-workers", "--stored-records", "640", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env={k: v for k, v in os.environ.items() if not k.startswith("AWS_")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    by_row = {(r["dataset"], r["row"]): r for r in rows}
    for dataset in ("shapes", "photos", "photos-tiled"):
        for row in ("energon_loader", "energon_same_work", "read", "decode", "sample"):
            assert by_row[dataset, row]["samples"] == 8 and by_row[dataset, row]["samples_per_s"] > 0
        assert by_row[dataset, "energon_same_work"]["x_same_work"] == 1.0
    cold, warm = by_row["photos", "object_cold"], by_row["photos", "object_warm"]
    copy_all = by_row["photos", "object_copy_all"]
    assert cold["bytes_from_store"] > 8 * 10_000  # the JPEGs and the shard index came over
    # 640 stored records in 10 shards: 8 samples need the first; what is fetched ahead lies
    # within the next 256 samples (4 shards).
    assert cold["bytes_from_store"] < copy_all["bytes_from_store"]
    # Through the filled cache only shards further ahead than the cold pass reached (at most 2).
    assert warm["bytes_from_store"] < cold["bytes_from_store"]
    assert all(r["first_sample_s"] > 0 for r in (cold, warm, copy_all))
