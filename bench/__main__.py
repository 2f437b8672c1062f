import argparse
import importlib
import pkgutil
import sys
from pathlib import Path

import bench

EXCLUDED = {"baseline", "docs", "report", "targets", "timeline"}


def available():
    return sorted(m.name for m in pkgutil.iter_modules([str(Path(bench.__file__).parent)])
                  if m.name not in EXCLUDED and not m.name.startswith("_"))


def main():
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("name", help=f"one of: all, {', '.join(available())}")
    args = parser.parse_args()
    names = available() if args.name == "all" else [args.name]
    for name in names:
        if name not in available():
            parser.error(f"no benchmark {name!r}; choose from {', '.join(available())}")
        importlib.import_module(f"bench.{name}").main()


if __name__ == "__main__":
    sys.exit(main())
