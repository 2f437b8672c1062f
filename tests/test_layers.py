"""The project's modules import each other without circles, counting imports inside functions (a
function-level import hides a circle from Python, not from a reader), and so do its packages: tenants/
never imports jobs/ (jobs builds on tenants), the client (trainyard/) imports no server package and no
library it does not declare, gpu_scheduler/ and learner_agent/ never import Django, and the agent imports
nothing but the standard library. Reads the source only (ast): nothing is imported or run."""
import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("portal", "tenants", "jobs", "notifications", "gpu_scheduler", "learner_agent", "trainyard")
SERVER_PACKAGES = ("portal", "tenants", "jobs", "notifications", "gpu_scheduler")


def project_modules():
    """{module name: path} of every module of the project's packages, tests and migrations excluded."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")) if (ROOT / package).is_dir() else ():
            parts = path.relative_to(ROOT).with_suffix("").parts
            if "tests" in parts or "migrations" in parts:
                continue
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def imports_of(name, path, known):
    """The project modules `name` imports, anywhere in its source (module level or in functions)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from jobs import states` imports jobs.states; `from jobs.models import Job` imports jobs.models.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph():
    modules = project_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycles(edges):
    """Every strongly connected group of more than one module (Tarjan), each as a sorted list."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return groups


def a_cycle_in(group, edges):
    """One concrete circle through the group's first module, to print: a -> b -> ... -> a."""
    start = group[0]
    paths = [[start]]
    seen = {start}
    while paths:
        path = paths.pop(0)
        for target in sorted(edges[path[-1]]):
            if target == start:
                return " -> ".join(path + [start])
            if target in group and target not in seen:
                seen.add(target)
                paths.append(path + [target])
    return " <-> ".join(group)


def test_no_module_imports_itself_back_through_others():
    edges = graph()
    cycles = find_cycles(edges)
    assert not cycles, "import circles:\n" + "\n".join(a_cycle_in(group, edges) for group in cycles)


def test_no_module_of_tenants_imports_jobs():
    offenders = {(name, target) for name, targets in graph().items()
                 if name == "tenants" or name.startswith("tenants.")
                 for target in targets if target == "jobs" or target.startswith("jobs.")}
    assert not offenders, sorted(offenders)


def test_it_keeps_notifications_on_top_of_jobs_and_tenants():
    # notifications/ listens to jobs' status changes and uses its outbox; jobs and tenants never
    # know it exists (it registers itself in NotificationsConfig.ready()).
    graph_ = graph()
    assert "notifications.services" in graph_, "the walk must see the notifications app"
    offenders = {(name, target) for name, targets in graph_.items()
                 if name.split(".")[0] in ("jobs", "tenants")
                 for target in targets if target.split(".")[0] == "notifications"}
    assert not offenders, sorted(offenders)


def test_the_walk_sees_function_level_imports():
    # The check above is only worth something if an import inside a function counts.
    assert "tenants.quotas" in graph()["jobs.apps"]  # imported inside JobsConfig.ready()
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def package_of(module):
    return module.split(".")[0]


def package_graph(edges=None):
    """{package: the other packages it imports}, from the module graph."""
    packages = {}
    for name, targets in (graph() if edges is None else edges).items():
        source = package_of(name)
        packages.setdefault(source, set()).update(
            package_of(target) for target in targets if package_of(target) != source)
    return packages


def libraries_imported(package):
    """{top-level name: [modules importing it]} of what `package`'s modules import from outside the
    project (absolute imports only; relative ones stay inside the package)."""
    found = {}
    for name, path in project_modules().items():
        if package_of(name) != package:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                tops = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                tops = [node.module.split(".")[0]]
            else:
                continue
            for top in tops:
                if top not in PACKAGES:
                    found.setdefault(top, []).append(name)
    return found


def test_no_package_imports_itself_back_through_others():
    edges = package_graph()
    cycles = find_cycles(edges)
    assert not cycles, "package circles:\n" + "\n".join(a_cycle_in(group, edges) for group in cycles)


def test_the_client_imports_no_server_package():
    offenders = {(name, target) for name, targets in graph().items() if package_of(name) == "trainyard"
                 for target in targets if package_of(target) in SERVER_PACKAGES}
    assert not offenders, sorted(offenders)


def test_the_client_imports_only_what_its_distribution_declares():
    # `pip install trainyard` brings the [project] dependencies and nothing else: the client may import
    # the standard library, itself, the (standard-library) agent and those, never a server extra's.
    declared = {_distribution(spec) for spec in
                tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    installed = importlib.metadata.packages_distributions()
    undeclared = {top: modules for top, modules in libraries_imported("trainyard").items()
                  if top not in sys.stdlib_module_names and top != "__future__"
                  and not {_distribution(d) for d in installed.get(top, [top])} & declared}
    assert not undeclared, f"the client imports libraries outside pyproject's [project] dependencies: {undeclared}"


def _distribution(spec):
    return re.split(r"[\s\[<>=!~;]", spec, maxsplit=1)[0].lower().replace("_", "-")


def test_the_scheduler_and_the_agent_never_import_django():
    for package in ("gpu_scheduler", "learner_agent"):
        assert "django" not in libraries_imported(package), (package, libraries_imported(package)["django"])


def test_the_agent_imports_only_the_standard_library_and_itself():
    # It is copied alone into learner pods and runs on the framework image's Python.
    outside = {top: modules for top, modules in libraries_imported("learner_agent").items()
               if top not in sys.stdlib_module_names}
    inside = {(name, target) for name, targets in graph().items() if package_of(name) == "learner_agent"
              for target in targets if package_of(target) != "learner_agent"}
    assert not outside and not inside, (outside, sorted(inside))


def test_the_package_rules_see_what_they_check():
    # Each rule above is only worth something if the walk finds the imports it judges.
    assert "yaml" in libraries_imported("trainyard")
    assert "tarfile" in libraries_imported("learner_agent")  # learner_agent.archive
    assert "django" in libraries_imported("jobs")
    assert package_graph({"a.x": {"b.y"}, "b.y": {"a.z"}, "a.z": set()}) == {"a": {"b"}, "b": {"a"}}
    assert _distribution("PyYAML>=6") == "pyyaml" and _distribution("celery[redis]>=5.4") == "celery"
