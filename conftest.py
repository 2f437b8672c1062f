"""Project-wide test set-up: the shared fixtures of the test-support package (tests/support, never
installed), loaded as a plugin for every test."""
pytest_plugins = ["tests.support.fixtures"]
