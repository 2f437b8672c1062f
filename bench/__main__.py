import argparse
import importlib
import pkgutil
import sys
from pathlib import Path

import bench
from bench import beside

EXCLUDED = {"baseline", "beside", "docs", "report", "targets", "timeline"}


def available():
    return sorted(m.name for m in pkgutil.iter_modules([str(Path(bench.__file__).parent)])
                  if m.name not in EXCLUDED and not m.name.startswith("_"))


def main():
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("name", help=f"one of: all, {', '.join(available())}")
    parser.add_argument("--beside", metavar="REV",
                        help="run it on git revision REV first, then here, and record REV's figures beside these")
    args = parser.parse_args()
    names = available() if args.name == "all" else [args.name]
    for name in names:
        if name not in available():
            parser.error(f"no benchmark {name!r}; choose from {', '.join(available())}")
        old = beside.run_at(args.beside, name) if args.beside else None
        importlib.import_module(f"bench.{name}").main()
        if old is not None:
            beside.record(name, *old)


if __name__ == "__main__":
    sys.exit(main())
