"""No shipped module reaches into the private members of Django, Channels, channels_redis, asgiref,
Celery, Django REST framework, drf-spectacular or mozilla-django-oidc: an ordinary upgrade of one of
them must not break the platform silently. The few overrides kept for a measured reason live in
portal/overrides/, each with a canary test of what it relies on (portal/overrides/tests), and their
library is pinned to a minor version.

Reads the source (ast). What counts as touching a private member `_x` (not a `__dunder__`):
- `name._x` where `name` (or the root of `name.a.b`) was imported from one of those libraries, or was
  assigned from an expression rooted at such a name, at `super()` or at `self` of a library subclass;
- `super()._x`, `self._x`, `cls._x` or `def _x` in a subclass of a library class, where a class of
  that library in the subclass's ancestry defines `_x` (as a method, a class attribute or `self._x = ...`);
  likewise `Sub._x` anywhere in the module, `Sub` being such a subclass.
"""
import ast
import importlib
import inspect
from functools import cache
from pathlib import Path

import pytest

from tests.support.shipped import PACKAGES, ROOT

LIBRARIES = ("django", "channels", "channels_redis", "asgiref", "celery", "rest_framework", "drf_spectacular",
             "mozilla_django_oidc")
OVERRIDES = ROOT / "portal" / "overrides"


def shipped_modules():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")) if (ROOT / package).is_dir() else ():
            parts = path.relative_to(ROOT).parts
            if "tests" in parts or "migrations" in parts or path.is_relative_to(OVERRIDES):
                continue
            yield path


def is_private(attr):
    return attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))


def library_of(module):
    top = (module or "").split(".")[0]
    return top if top in LIBRARIES else None


def imported_names(tree):
    """{local name: dotted path of what it names} for every import from the libraries, anywhere."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if library_of(alias.name):
                    local = alias.asname or alias.name.split(".")[0]
                    names[local] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and not node.level and library_of(node.module):
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def root_of(node):
    """The innermost expression an attribute chain, call, await or subscript starts from."""
    while True:
        if isinstance(node, ast.Attribute | ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Call) and not is_super_call(node):
            node = node.func
        elif isinstance(node, ast.Await):
            node = node.value
        else:
            return node


def is_super_call(node):
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def resolve(dotted):
    """The object a dotted path names (module, then attributes), or None."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for part in parts[cut:]:
                target = getattr(target, part)
        except AttributeError:
            return None
        return target
    return None


def dotted_name(node, imported):
    """`pubsub.RedisPubSubChannelLayer` -> 'channels_redis.pubsub.RedisPubSubChannelLayer', if rooted at an import."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in imported:
        return ".".join([imported[node.id], *reversed(parts)])
    return None


@cache
def members_defined_by(cls):
    """The private names the library classes in `cls`'s ancestry define: methods, class attributes,
    and attributes their methods assign on self."""
    found = set()
    for ancestor in inspect.getmro(cls):
        if not library_of(ancestor.__module__):
            continue
        found.update(name for name in vars(ancestor) if is_private(name))
        try:
            source = inspect.getsource(ancestor)
        except (OSError, TypeError):
            continue
        for node in ast.walk(ast.parse(inspect.cleandoc("\n" + source) if source[:1].isspace() else source)):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name) and node.value.id == "self" and is_private(node.attr)):
                found.add(node.attr)
    return frozenset(found)


def library_bases(node, imported):
    classes = []
    for base in node.bases:
        dotted = dotted_name(base, imported)
        target = resolve(dotted) if dotted else None
        if inspect.isclass(target):
            classes.append(target)
    return classes


def findings(source, where):
    """'where:line: what' for each private member of the libraries that the source touches."""
    tree = ast.parse(source, str(where))
    imported = imported_names(tree)
    found = []

    classes = [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    # {name of a subclass of a library class: the private names its library ancestry defines}
    subclasses = {cls.name: frozenset().union(*(members_defined_by(base) for base in bases))
                  for cls in classes for bases in [library_bases(cls, imported)] if bases}

    def check_scope(body_nodes, *, library_defined=frozenset()):
        tainted = set(imported)
        # A name bound from a library expression is a library object too (`layer = super()._get_layer()`).
        for node in (n for top in body_nodes for n in ast.walk(top)):
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                root = root_of(node.value)
                from_library = ((isinstance(root, ast.Name) and (root.id in tainted or
                                                                 (library_defined and root.id in ("self", "cls"))))
                                or is_super_call(root))
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if from_library:
                    tainted.update(t.id for t in targets if isinstance(t, ast.Name) and t.id not in ("self", "cls"))
        for node in (n for top in body_nodes for n in ast.walk(top)):
            if isinstance(node, ast.Attribute) and is_private(node.attr):
                base = node.value
                if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                    if node.attr in library_defined:
                        found.append(f"{where}:{node.lineno}: {base.id}.{node.attr} (defined by the library class)")
                elif is_super_call(base):
                    if library_defined:
                        found.append(f"{where}:{node.lineno}: super().{node.attr}")
                elif isinstance(base, ast.Name) and node.attr in subclasses.get(base.id, ()):
                    found.append(f"{where}:{node.lineno}: {base.id}.{node.attr} (defined by the library class)")
                else:
                    root = root_of(base)
                    if isinstance(root, ast.Name) and root.id in tainted:
                        found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
            elif (isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in library_defined
                  and is_private(node.name)):
                found.append(f"{where}:{node.lineno}: overrides {node.name}")

    in_classes = {id(n) for cls in classes if cls.name in subclasses for n in ast.walk(cls)}
    check_scope([node for node in tree.body if id(node) not in in_classes])
    for cls in classes:
        if cls.name in subclasses:
            check_scope(cls.body, library_defined=subclasses[cls.name])
    return sorted(set(found))


def test_no_shipped_module_outside_the_overrides_touches_a_private_member_of_the_libraries():
    found = [line for path in shipped_modules() for line in findings(path.read_text(), path.relative_to(ROOT))]
    assert found == [], "private members of Django/Channels/channels_redis/asgiref/Celery/DRF:\n" + "\n".join(found)


@pytest.mark.parametrize("source, expected", [
    ("from django.db import connection\nconnection._cursor()", ["connection._cursor"]),
    ("import django.db\ndjango.db.connection._savepoint_ids", ["django.db.connection._savepoint_ids"]),
    ("from asgiref.sync import SyncToAsync\nx = SyncToAsync.threadlocal._loop", ["SyncToAsync.threadlocal._loop"]),
    ("from channels.layers import get_channel_layer\nlayer = get_channel_layer()\nlayer._x", ["layer._x"]),
    ("from django.core.cache.backends.redis import RedisCache\n"
     "class C(RedisCache):\n    def __init__(self, s, p):\n        super().__init__(s, p)\n        self._class = 1",
     ["self._class (defined by the library class)"]),
    ("from channels_redis import pubsub\nclass L(pubsub.RedisPubSubChannelLayer):\n"
     "    def _get_layer(self):\n        layer = super()._get_layer()\n        return layer._shards",
     ["layer._shards", "overrides _get_layer", "super()._get_layer"]),
    ("from rest_framework import serializers\nclass S(serializers.Serializer):\n    pass\n"
     "S._declared_fields['global'] = serializers.IntegerField()",
     ["S._declared_fields (defined by the library class)"]),
])
def test_it_finds_private_members_of_the_libraries(source, expected):
    assert sorted(line.split(": ", 1)[1] for line in findings(source, "probe.py")) == sorted(expected)


@pytest.mark.parametrize("source", [
    "import requests\nrequests._x",  # not one of the libraries
    "from django.db import connection\nconnection.__class__",  # a dunder
    "from django.core.cache.backends.redis import RedisCache\n"
    "class C(RedisCache):\n    def go(self):\n        self._mine = 1",  # the subclass's own name
    "from django.conf import settings\nx = settings.DEBUG",
])
def test_it_leaves_public_and_own_members_alone(source):
    assert findings(source, "probe.py") == []
