"""Run the benchmarks, print a short table per benchmark and write JSON.

python -m benchmarks.run                 # full size (a few minutes: idle CPU alone takes 60 s)
python -m benchmarks.run --smoke         # tiny sizes, seconds (the tests run this)
python -m benchmarks.run --only admission scale
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from . import (
    admission,
    dra,
    dra_slices,
    dra_start,
    dra_tenants,
    dynamic_mig,
    extender,
    footprint,
    hostile,
    kubelet_link,
    recovery,
    restart_storm,
    scale,
    scrape,
    stop,
)

BENCHMARKS = {
    "admission": admission,
    "scale": scale,
    "recovery": recovery,
    "footprint": footprint,
    "scrape": scrape,
    "kubelet_link": kubelet_link,
    "extender": extender,
    "hostile": hostile,
    "dra": dra,
    "dra_slices": dra_slices,
    "dra_tenants": dra_tenants,
    "dra_start": dra_start,
    "dynamic_mig": dynamic_mig,
    "stop": stop,
    "restart_storm": restart_storm,
}


def _print(name: str, result: dict, indent: str = "  ") -> None:
    print(name)
    for key, value in result.items():
        if isinstance(value, dict):
            print(f"{indent}{key}: " + ", ".join(f"{k}={v}" for k, v in value.items()))
        elif isinstance(value, list):
            print(f"{indent}{key}:")
            for row in value:
                print(f"{indent}  " + ", ".join(f"{k}={v}" for k, v in row.items()))
        else:
            print(f"{indent}{key}: {value}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check the benchmarks still run")
    parser.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), help="run only these")
    parser.add_argument("--out", default="benchmarks/results", help="directory for the JSON results")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or "?",
        "cpus": __import__("os").cpu_count(),
    }
    for name in args.only or BENCHMARKS:
        started = time.perf_counter()
        result = BENCHMARKS[name].run(smoke=args.smoke)
        result["seconds"] = round(time.perf_counter() - started, 1)
        _print(name, result)
        (out / f"{name}{'-smoke' if args.smoke else ''}.json").write_text(
            json.dumps({"machine": machine, "smoke": args.smoke, **result}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
