"""Canaries: each fails when a library internal that portal/overrides relies on changes shape, so an
upgrade past the pinned minor version is noticed here rather than in production."""
import inspect
from importlib.metadata import version

from django.core.handlers.asgi import ASGIHandler
from django.core.handlers import exception


def parameters(function):
    return list(inspect.signature(function).parameters)


def test_the_ingest_route_finds_the_asgi_handler_methods_it_calls():
    """portal.overrides.ingest builds a post's request and sends its response with Django's
    ASGIHandler (the body it reads itself, within bounds), and answers an error with Django's own
    exception handling."""
    assert parameters(ASGIHandler.create_request) == ["self", "scope", "body_file"]
    assert parameters(ASGIHandler.send_response) == ["self", "response", "send"]
    assert parameters(exception.response_for_exception) == ["request", "exc"]
    assert inspect.iscoroutinefunction(ASGIHandler.send_response)
    assert not inspect.iscoroutinefunction(ASGIHandler.create_request)  # returns (request, error response)


def test_django_is_the_minor_version_the_overrides_were_checked_against():
    assert version("django").split(".")[:2] == ["5", "2"]  # pyproject.toml pins Django>=5.2,<5.3
