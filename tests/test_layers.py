"""The project's modules import each other without circles, counting imports inside functions (a
function-level import hides a circle from Python, not from a reader), and tenants/ never imports jobs/
(jobs builds on tenants). Reads the source only (ast): nothing is imported or run."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("portal", "tenants", "jobs", "notifications", "gpu_scheduler", "learner_agent", "trainyard")


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
