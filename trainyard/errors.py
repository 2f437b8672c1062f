"""The errors the Trainyard client raises: one family, so a script can catch `TrainyardError` alone or
tell apart what it can act on (`NotFound`, `BadRequest` with the field the server named, a transient
`ServerError`...). Every message is one readable line; the CLI prints it as it is."""


class TrainyardError(Exception):
    """Anything the client could not do. `transient` ones (network, 5xx, 429) are worth retrying."""

    transient = False

    def __init__(self, message, *, transient=None):
        super().__init__(message)
        if transient is not None:
            self.transient = transient


class UsageError(TrainyardError):
    """A problem on this side, before or without the server: configuration, the code or manifest given."""


class ConfigError(UsageError):
    """No URL or token configured, an unreadable saved configuration, a malformed URL."""


class PackingError(UsageError):
    """The code directory or archive cannot be sent (a symlink leading outside it, not an archive...)."""


class ConnectionFailed(TrainyardError):
    """The server could not be reached or did not answer in time."""

    transient = True


class WaitTimeout(TrainyardError):
    """`Client.wait` gave up before the job reached one of the wanted statuses."""

    def __init__(self, message, *, job):
        super().__init__(message)
        self.job = job


class ApiError(TrainyardError):
    """The server answered with an error: `status` (HTTP), `detail` and `field` (the part of the
    request it refers to, e.g. `memory` or `framework.command`, when the server named one)."""

    def __init__(self, message, *, status, detail="", field=None, transient=None):
        super().__init__(message, transient=transient)
        self.status, self.detail, self.field = status, detail, field


class BadRequest(ApiError):
    """400 (or 413): the manifest, the code or a parameter was refused; `field` says which."""


class Unauthorized(ApiError):
    """401/403: no valid token, or not allowed."""


class NotFound(ApiError):
    """404: no such job in the tenant (another tenant's job answers the same)."""


class Conflict(ApiError):
    """409: not allowed in the job's current status (halting a completed job...)."""


class ServerError(ApiError):
    """5xx or 429: the server failed or is busy; retrying later can help."""

    transient = True


_CLASS_OF_STATUS = {400: BadRequest, 413: BadRequest, 422: BadRequest, 401: Unauthorized, 403: Unauthorized,
                    404: NotFound, 409: Conflict, 429: ServerError}


def api_error_class(status):
    return ServerError if status >= 500 else _CLASS_OF_STATUS.get(status, ApiError)
