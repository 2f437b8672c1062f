"""What every portal page's frame needs about the signed-in user: the invitations waiting for them,
shown as a badge on the Account link so they never hide on a page nobody opens."""
from tenants import people


def pending_invitations(request):
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {}
    return {"pending_invitations": people.invitations_for(user).count()}
