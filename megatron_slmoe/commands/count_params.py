"""Parameter census of a model config: total and active-per-token parameters, by component.

The whole model (no tensor, pipeline or expert parallelism) is built on the meta device, so even
the 2.8e12-parameter flagship takes no memory and a few seconds.

    slmoe-count-params --model-config flagship_2p8t          # a table
    slmoe-count-params --model-config my_model.yaml --json   # one JSON object on stdout

Bad input (missing file, invalid YAML, invalid configuration) is one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import sys
import time

from megatron_slmoe.commands.cli import user_errors
from megatron_slmoe.training.cli import add_run_flags
from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.model.census import count_parameters
from megatron_slmoe.model.model_file import load_model_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_flags(parser, "model.config", required=["model.config"])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def _human(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3f} {unit}"
    return str(n)


def _table(census: dict) -> str:
    total = census["total_params"]
    lines = [
        f"model {census['config']} ({census['source']})",
        f"  {'total parameters':<28}{total:>20,}  {_human(total)}",
        f"  {'active per token':<28}{census['active_params_per_token']:>20,}  "
        f"{_human(census['active_params_per_token'])} ({census['active_fraction']:.3%})",
        f"  {'routed experts':<28}{census['num_moe_experts']:>20} top-{census['moe_router_topk']} "
        f"in {census['num_moe_layers']} of {census['num_layers']} layers",
    ]
    for name, count in census["breakdown"].items():
        lines.append(f"    {name:<26}{count:>20,}  {count / total:.3%}")
    lines.append(f"  built on meta in {census['build_seconds']:.2f} s, "
                 f"peak RSS {census['peak_rss_mib']:.0f} MiB")
    return "\n".join(lines)


@user_errors(ConfigError)
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("megatron").setLevel(logging.ERROR)  # construction chatter
    model_config = load_model_config(args.model_config)
    start = time.perf_counter()
    census = count_parameters(model_config)
    census = {
        "config": model_config.name, "source": model_config.source, **census,
        "build_seconds": round(time.perf_counter() - start, 3),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    print(json.dumps(census) if args.json else _table(census))
    return 0


if __name__ == "__main__":
    sys.exit(main())
