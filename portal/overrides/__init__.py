"""The platform's uses of library internals, kept for a measured gain that the libraries' public
extension points cannot give. Each module says in its docstring what it relies on and why; each
has a canary test in portal/overrides/tests that fails when what it relies on changes, and its
library is pinned to a minor version in pyproject.toml. Nothing outside this package may touch a
private member of Django, Channels, channels_redis, asgiref, Celery or Django REST framework
(tests/test_private_hooks.py).
"""
