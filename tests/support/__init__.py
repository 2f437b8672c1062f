"""Test support shared by the end-to-end, chaos and security suites and the benchmarks (which run
from the repository root, so they import it as `tests.support`). Not part of the installed package."""
