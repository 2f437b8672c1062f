"""The Content-Security-Policy every response carries.

Pages run only scripts served from the platform itself (static/js, static/vendor): no inline
script, no event-handler attribute, no eval, so markup that slipped through escaping (a job name, a
log line) cannot run. They may connect only to the platform's own API and websockets, and no other
site may frame them (clickjacking). Django's SecurityMiddleware and XFrameOptionsMiddleware already
send X-Content-Type-Options: nosniff, Referrer-Policy: same-origin and X-Frame-Options: DENY.

Third-party pages the platform serves (the admin console, the Swagger UI) carry a few inline
`<style>` blocks and style attributes of their own; they alone may use inline styles, never scripts.
"""

from django.core.exceptions import DisallowedHost

THIRD_PARTY_PAGES = ("/admin/", "/api/docs/")


def policy(host, path):
    """host: the validated Host the page was served as, or None."""
    sockets = f" ws://{host} wss://{host}" if host else ""
    styles = "'self' 'unsafe-inline'" if path.startswith(THIRD_PARTY_PAGES) else "'self'"
    return "; ".join([
        "default-src 'self'",
        "script-src 'self'",
        f"style-src {styles}",
        "img-src 'self' data:",
        "font-src 'self'",
        # 'self' covers same-host websockets in CSP 3; the explicit ws(s) origins are for browsers before it.
        f"connect-src 'self'{sockets}",
        "object-src 'none'",
        "base-uri 'self'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ])


class ContentSecurityPolicyMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        try:
            host = request.get_host()  # checked against ALLOWED_HOSTS, so safe to put in a header
        except DisallowedHost:
            host = None
        response.setdefault("Content-Security-Policy", policy(host, request.path))
        return response
