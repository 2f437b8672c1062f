"""Test support: the builders, fakes and fixtures that the unit tests, the end-to-end, chaos and
security suites and the benchmarks share (they run from the repository root, so they import it as
`tests.support`; the root conftest.py loads `fixtures.py` as a pytest plugin). Never installed."""
