"""The webhooks section of the account settings: add and remove hooks, see each one's delivery log.
Plain forms (no script: the CSP forbids inline ones and none is needed); the new secret is shown once."""
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect, render
from django.views.decorators.cache import never_cache

from notifications import services
from notifications.models import Delivery, Webhook
from tenants import access

LOG_ROWS = 20


@never_cache  # it shows a new hook's secret once: no browser or proxy may keep a copy
@login_required
def webhooks_page(request):
    try:
        membership = access.request_membership(request)
    except access.NoTenant:
        return redirect("/account/tokens/")
    created = None
    if request.method == "POST":
        created = _change(request, membership)
        if created is None:
            return redirect(request.path)
    hooks = list(services.hooks_of(membership).order_by("pk"))
    for hook in hooks:
        hook.log = list(Delivery.objects.filter(webhook=hook).order_by("-pk")[:LOG_ROWS])
    return render(request, "notifications/webhooks.html", {
        "membership": membership, "hooks": hooks, "created": created, "events": services.EVENTS,
        "formats": Webhook.Format.values})


def _change(request, membership):
    """Add or remove a hook as the form asks; (hook, secret) when one was added, else None."""
    action = request.POST.get("action")
    if action == "create":
        try:
            return services.create(membership, url=request.POST.get("url"),
                                   events=request.POST.getlist("events"),
                                   format=request.POST.get("format") or "slack",
                                   scope=request.POST.get("scope") or "user")
        except services.HookError as exc:
            messages.error(request, f"{exc.field or 'webhook'}: {exc.detail}.")
    elif action == "delete":
        hook = services.hooks_of(membership).filter(pk=_number(request.POST.get("hook"))).first()
        if hook is not None:
            services.remove(hook)
            messages.success(request, f"Removed the webhook to {hook.url}.")
    return None


def _number(value):
    value = str(value or "")
    return int(value) if value.isascii() and value.isdigit() else None  # "²" is a digit int() refuses
