"""Fields set on top of a manifest file (`trainyard train --set KEY=VALUE --name NAME`, and the SDK's
`submit(overrides=..., name=...)`), so runs that differ in a field or two need no copy of the file each:

    trainyard train manifest.yml ./code --set framework.command='python train.py --lr 0.01' --set learners=2

A KEY is a field's dotted path (`framework.command`, `checkpoint.grace_seconds`; a list item by its index,
`data_stores.0.id`). The fields are set on the manifest's mapping before it is validated, so a path that
names no field is refused by the manifest's own rules, naming it (`framework.comand: unknown field; did
you mean 'command'?`), and a value out of range likewise.
"""
import copy
import re
from collections.abc import Mapping

import yaml

from trainyard.manifest import ManifestError, load_fields, shown

KEY = re.compile(r"[^.=\s]+(?:\.[^.=\s]+)*")
# What YAML 1.1 reads as text but people write as a number: 1e-4 (PyYAML wants 1.0e-4).
EXPONENT = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+")
EXAMPLE = "framework.command=python train.py, learners=2"


def parse(text):
    """(dotted path, value) of one `KEY=VALUE`. VALUE is read as a YAML scalar: `2` is a number, `true`
    a boolean, `null` nothing, `"2"` (quoted) text; any other VALUE is the text as written, so a command
    with `: ` or ` #` in it is not taken for YAML syntax. ManifestError when it is not KEY=VALUE."""
    key, equals, value = str(text).partition("=")
    key = key.strip()
    if not equals or not KEY.fullmatch(key):
        raise ManifestError("--set", f"{str(text)[:60]!r} is not KEY=VALUE with KEY a field's dotted path "
                                     f"({EXAMPLE})")
    return key, value_of(value)


def value_of(text):
    """A VALUE of `KEY=VALUE` as parse() reads it."""
    text = text.strip()
    if not text:
        return ""
    try:
        value = yaml.safe_load(text)
    except (yaml.YAMLError, ValueError, OverflowError, RecursionError):
        return text
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str) and text[0] in "'\"":
        return value
    if EXPONENT.fullmatch(text):
        return float(text)
    return text  # plain text, or what YAML would read as a list, mapping or date: the text as given


def pairs(overrides=None, *, name=None):
    """The (path, value) pairs to apply, in order: `overrides` may be a mapping {path: value}, or a list of
    (path, value) pairs and `KEY=VALUE` texts (read by parse()); `name`, when given, is set last."""
    items = overrides.items() if isinstance(overrides, Mapping) else (overrides or ())
    found = [parse(item) if isinstance(item, str) else tuple(item) for item in items]
    if name is not None:
        found.append(("name", str(name)))
    return found


def apply(fields, overrides):
    """A copy of a manifest's mapping of fields with each (path, value) of `overrides` set in turn. A
    section on the way that is missing is added (what it holds is checked when the manifest is validated);
    ManifestError naming the path when something on the way is a value, not a section, or no such item."""
    fields = copy.deepcopy(fields)
    for path, value in overrides:
        _set(fields, str(path), value)
    return fields


def overridden(text, overrides):
    """The manifest YAML text (str or bytes) with `overrides` ((path, value) pairs) applied, as UTF-8 YAML
    bytes to upload; the text as it was when there are none. Comments are not kept in an overridden
    manifest. Checks the text's bounds and the paths only: parse_manifest() on the result checks the rest."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    if not overrides:
        return data
    fields = apply(load_fields(data), overrides)
    return yaml.safe_dump(fields, sort_keys=False, allow_unicode=True, default_flow_style=False,
                          width=10_000).encode("utf-8")


def _set(fields, path, value):
    if not KEY.fullmatch(path):
        raise ManifestError(path or "--set", f"is not a field's dotted path ({EXAMPLE})")
    parts = path.split(".")
    node = fields
    for depth, part in enumerate(parts):
        where = ".".join(parts[:depth])
        if isinstance(node, list):
            key = _index(node, part, path, where)
        elif isinstance(node, dict):
            key = part
        else:
            raise ManifestError(path, f"{where} is {shown(node)}, not a section with fields")
        if depth == len(parts) - 1:
            node[key] = value
        else:
            if isinstance(node, dict) and node.get(key) is None:
                node[key] = {}
            node = node[key]


def _index(items, part, path, where):
    if not part.isdigit():
        raise ManifestError(path, f"{where} is a list; name an item by its index ({where}.0.{part})")
    if int(part) >= len(items):
        raise ManifestError(path, f"{where} has {len(items)} item{'s' if len(items) != 1 else ''}; "
                                  f"{part} is past its end" if items else f"{where} is an empty list")
    return int(part)
