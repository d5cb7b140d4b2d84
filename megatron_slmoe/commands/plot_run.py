"""Pictures of a run: PNGs of its loss, accuracy, learning rate, gradient norm, throughput, expert
load and routing drift, drawn from the run directory's metrics.jsonl and summary.json.

    slmoe-plot-run runs/demo/lora-20250101-120000          # -> <run>/plots/*.png
    slmoe-plot-run RUN_DIR --out-dir pictures/

A directory without metrics is one line on stderr and exit code 2. (See
megatron_slmoe.training.reporting.plots for what each picture shows.)
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from megatron_slmoe.commands.cli import user_errors
from megatron_slmoe.training.reporting.plots import plot_run


@user_errors("megatron_slmoe.training.reporting.plots.RunDataError")
def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="slmoe-plot-run", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the output directory of a run")
    parser.add_argument("--out-dir", help="where the PNGs go [default: RUN_DIR/plots]")
    args = parser.parse_args(argv)
    paths = plot_run(args.run_dir, args.out_dir)
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
