"""docker-compose.yml without Docker: valid against the compose specification's JSON schema (as
check-jsonschema vendors it, with its licence), every platform service's command present in the image
the Dockerfile builds (management commands exist and take the options given, the Celery app imports,
the web server's target resolves), and every variable it sets one that the platform reads."""
import importlib
import json
import re
import shlex
import subprocess
import sys
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
import yaml
from celery import Celery
from django.core.management import get_commands, load_command_class

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
DOCKERFILE = (ROOT / "Dockerfile").read_text()
SERVICES = COMPOSE["services"]
# The services that run the image this repository builds (the rest are upstream images).
PLATFORM = {name: s for name, s in SERVICES.items() if s.get("build") == "."}


def image_command():
    """The Dockerfile's CMD (exec form): what a service without `command` runs."""
    return json.loads(re.search(r"^CMD (\[.*\])$", DOCKERFILE, re.M).group(1))


def command_of(service):
    command = service.get("command", image_command())
    return shlex.split(command) if isinstance(command, str) else list(command)


def settings_variables():
    """The environment variables portal/settings.py reads (through portal.env or os.environ)."""
    source = (ROOT / "portal" / "settings.py").read_text()
    return set(re.findall(r"""env\.\w+\(\s*["']([A-Z][A-Z0-9_]*)["']""", source)) | set(
        re.findall(r"""os\.environ(?:\.get)?[\[(]\s*["']([A-Z][A-Z0-9_]*)["']""", source))


def test_it_is_valid_against_the_compose_specification():
    schema = json.loads(resources.files("check_jsonschema.builtin_schemas.vendor")
                        .joinpath("compose-spec.json").read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(COMPOSE)]
    assert not errors, errors


def test_it_runs_the_platform_and_the_services_it_needs():
    assert {"postgres", "redis", "minio", "minio-setup", "migrate", "web", "worker", "scheduler", "webhooks",
            "beat"} <= set(SERVICES)
    assert set(PLATFORM) == {"migrate", "web", "worker", "scheduler", "webhooks", "beat"}
    for name in PLATFORM:
        # (A service's own depends_on replaces the x-trainyard one: YAML merge keys are shallow.)
        assert {"postgres", "redis"} <= started_before(name), name
    assert all("migrate" in started_before(name) for name in ("web", "worker", "scheduler"))
    assert SERVICES["scheduler"]["deploy"]["replicas"] == 2  # a leader and a standby


def started_before(name):
    """Every service `name` waits for, directly or through the services it waits for."""
    waiting, seen = [name], set()
    while waiting:
        for dependency in SERVICES[waiting.pop()].get("depends_on", {}):
            if dependency not in seen:
                seen.add(dependency)
                waiting.append(dependency)
    return seen


def test_the_image_installs_the_project_with_the_programs_the_commands_run():
    assert re.search(r'pip install [^\n]*-e "\.\[', DOCKERFILE), "the Dockerfile installs the project"
    assert "COPY . ." in DOCKERFILE and "WORKDIR /app" in DOCKERFILE
    # What the image installs: the client's dependencies and those of the extras it names (server, ...).
    project = __import__("tomllib").loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = re.search(r'pip install [^\n]*-e "\.\[([^\]]*)\]"', DOCKERFILE).group(1).split(",")
    dependencies = " ".join(project["dependencies"] + [d for e in extras for d in project["optional-dependencies"][e]])
    programs = {command_of(s)[0] for s in PLATFORM.values()}
    assert programs <= {"python", "celery"}, programs
    assert "celery[redis]" in dependencies and "uvicorn" in dependencies  # `celery` and `python -m uvicorn`


@pytest.mark.parametrize("name", sorted(name for name, s in PLATFORM.items() if command_of(s)[1:2] == ["manage.py"]))
def test_its_management_commands_exist_and_take_their_options(name):
    argv = command_of(PLATFORM[name])
    assert (ROOT / "manage.py").is_file()
    command = argv[2]
    app = get_commands().get(command)
    assert app, f"{name}: no management command {command!r}"
    parser = load_command_class(app, command).create_parser("manage.py", command)
    parser.parse_args(argv[3:])  # an unknown option fails here (CommandError)


def test_the_web_server_target_resolves_to_the_asgi_application():
    argv = command_of(SERVICES["web"])
    assert argv[:3] == ["python", "-m", "uvicorn"]
    from uvicorn.importer import import_from_string
    from uvicorn.main import main

    from portal.runner import WEB_SERVER_OPTIONS

    args = main.make_context("uvicorn", argv[3:]).params  # an unknown option fails here
    assert args["port"] == 8000 and f"{args['port']}:{args['port']}" in SERVICES["web"]["ports"]
    assert args["proxy_headers"] is False and args["lifespan"] == "off"  # as the platform runs it
    assert argv[-len(WEB_SERVER_OPTIONS):] == list(WEB_SERVER_OPTIONS)
    application = import_from_string(args["app"])
    assert callable(application) and application is importlib.import_module("portal.asgi").application


@pytest.mark.parametrize("name", sorted(name for name, s in PLATFORM.items() if command_of(s)[0] == "celery"))
def test_its_celery_commands_load_the_app(name):
    argv = command_of(PLATFORM[name])
    assert argv[1] == "-A"
    assert isinstance(importlib.import_module(argv[2]).app, Celery)
    # The real command line, up to running: Celery loads the app and parses the sub-command's options.
    result = subprocess.run([str(Path(sys.executable).with_name("celery")), *argv[1:], "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"Usage: celery {argv[3]}" in result.stdout


def test_every_variable_it_sets_is_one_the_settings_read():
    read = settings_variables()
    assert {"DATABASE_URL", "REDIS_URL", "TRAINYARD_SECRET_KEY"} <= read  # the parse found them
    for name, service in PLATFORM.items():
        unknown = set(service["environment"]) - read
        assert not unknown, f"{name} sets {sorted(unknown)}, which portal/settings.py does not read"


def test_minio_is_the_data_store_the_platform_may_reach():
    environment = PLATFORM["worker"]["environment"]
    assert "minio" in environment["TRAINYARD_DATASTORE_ALLOWED_HOSTS"].split(",")
    setup = " ".join(SERVICES["minio-setup"]["command"])
    assert "http://minio:9000" in setup and "mc mb" in setup
    assert SERVICES["minio-setup"]["depends_on"]["minio"]["condition"] == "service_healthy"
