"""Benchmarks (SPEC §7): `python -m bench NAME` runs one, `python -m bench all` runs every one."""
