"""`python -m bench NAME --beside REV`: the benchmark run on another revision of the code (a git
worktree of REV, run first, in a process of its own) and then on this one, in the same sitting, so a
change is judged against the old code on the same machine in the same hour (these machines drift
2-3x by the hour). The old code's headline figures go into this run's results under `beside`, and
the benchmarks page shows them in a column of their own."""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.report import RESULTS
from bench.targets import bench as declared

ROOT = Path(__file__).resolve().parent.parent


def run_at(revision, name):
    """The benchmark `name` run on `revision`: (the commit it resolved to, its results)."""
    commit = _git("rev-parse", "--short", f"{revision}^{{commit}}").strip()
    folder = Path(tempfile.mkdtemp(prefix="trainyard-beside-")) / commit
    _git("worktree", "add", "--detach", str(folder), commit)
    try:
        # `-m` puts the worktree first on the path, ahead of this checkout's editable install.
        subprocess.run([sys.executable, "-m", "bench", name], cwd=folder, check=True)
        return commit, json.loads((folder / "bench" / "results" / f"{name}.json").read_text())
    finally:
        _git("worktree", "remove", "--force", str(folder))


def record(name, commit, old):
    """Add the old code's headline figures to this run's results file."""
    path = RESULTS / f"{name}.json"
    results = json.loads(path.read_text())
    keys = [figure.key for figure in declared(name).figures]
    results["beside"] = {"revision": commit, "measured_at": old.get("measured_at"),
                         "figures": {key: old.get(key) for key in keys}}
    path.write_text(json.dumps(results, indent=2) + "\n")


def _git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout
