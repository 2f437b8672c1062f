"""The browser libraries the portal serves from static/vendor/, and the check that they are the ones
package-lock.json pins.

The pages load nothing from a CDN (clusters are often offline). `make assets` runs `npm ci` and then
`python -m portal.assets`, which copies the files below out of node_modules/ and records, in
static/vendor/manifest.json, the version and npm integrity hash each was taken from. The copies are
committed, so `make demo` never needs npm; `check()` (run by the test suite) proves the committed
copies match the lockfile, and match node_modules/ byte for byte when it is there.
"""
import hashlib
import json
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCKFILE = ROOT / "package-lock.json"
NODE_MODULES = ROOT / "node_modules"
VENDOR = ROOT / "static" / "vendor"
MANIFEST = VENDOR / "manifest.json"

# npm package -> (folder under static/vendor, files to copy, regex that finds the version in the first file)
VENDORED = {
    "htmx.org": ("htmx", ["dist/htmx.min.js", "LICENSE"], r'version:"([0-9][^"]*)"'),
    "uplot": ("uplot", ["dist/uPlot.iife.min.js", "dist/uPlot.min.css", "LICENSE"], r"\(v([0-9][^)]*)\)"),
}


def locked_packages():
    packages = json.loads(LOCKFILE.read_text())["packages"]
    return {name: packages[f"node_modules/{name}"] for name in VENDORED}


def _sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def copy_from_node_modules():
    """Copy each vendored file out of node_modules/ (after `npm ci`) and write the manifest."""
    locked = locked_packages()
    manifest = {}
    for name, (folder, files, _) in VENDORED.items():
        installed = json.loads((NODE_MODULES / name / "package.json").read_text())
        if installed["version"] != locked[name]["version"]:
            raise SystemExit(f"node_modules/{name} is {installed['version']} but package-lock.json pins "
                             f"{locked[name]['version']}: run `npm ci` first")
        target = VENDOR / folder
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        copied = {}
        for source in files:
            destination = target / Path(source).name
            shutil.copyfile(NODE_MODULES / name / source, destination)
            copied[destination.name] = _sha256(destination)
        manifest[name] = {"version": locked[name]["version"], "integrity": locked[name]["integrity"],
                          "license": installed.get("license", ""), "folder": folder, "files": copied}
    MANIFEST.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def check():
    """Every way the committed copies can disagree with package-lock.json, as readable lines."""
    problems = []
    if not MANIFEST.exists():
        return [f"{MANIFEST.relative_to(ROOT)} is missing: run `make assets`"]
    manifest = json.loads(MANIFEST.read_text())
    for name, lock in locked_packages().items():
        folder, files, version_pattern = VENDORED[name]
        entry = manifest.get(name)
        if entry is None:
            problems.append(f"{name} is not in static/vendor/manifest.json: run `make assets`")
            continue
        for key in ("version", "integrity"):
            if entry[key] != lock[key]:
                problems.append(f"{name}: static/vendor has {key} {entry[key]!r}, package-lock.json {lock[key]!r}")
        first = VENDOR / folder / Path(files[0]).name
        found = re.search(version_pattern, first.read_text(errors="replace")[:200_000]) if first.exists() else None
        if not found or found.group(1) != lock["version"]:
            problems.append(f"{first.relative_to(ROOT)} does not say version {lock['version']}")
        for source in files:
            copy = VENDOR / folder / Path(source).name
            if not copy.exists():
                problems.append(f"{copy.relative_to(ROOT)} is missing: run `make assets`")
                continue
            if _sha256(copy) != entry["files"].get(copy.name):
                problems.append(f"{copy.relative_to(ROOT)} was changed by hand: run `make assets`")
            original = NODE_MODULES / name / source
            if original.exists() and json.loads((NODE_MODULES / name / "package.json").read_text())[
                    "version"] == lock["version"] and original.read_bytes() != copy.read_bytes():
                problems.append(f"{copy.relative_to(ROOT)} differs from node_modules/{name}/{source}")
    return problems


if __name__ == "__main__":
    copied = copy_from_node_modules()
    for package, entry in copied.items():
        print(f"static/vendor/{entry['folder']}: {package} {entry['version']} ({entry['license']})")
    if problems := check():
        sys.exit("\n".join(problems))
