"""Private jobs and per-object sharing (django-guardian) inside one tenant."""
import pytest

from jobs.models import Status
from tests.support.builders import client_for, job, member

pytestmark = pytest.mark.django_db


@pytest.fixture
def team():
    return {"alice": member("team-a", "alice"), "bob": member("team-a", "bob"),
            "vera": member("team-a", "vera", role="viewer"), "ada": member("team-a", "ada", role="admin")}


def test_a_private_job_is_invisible_to_colleagues_until_shared(team):
    secret = job(team["alice"], private=True)
    bob = client_for(team["bob"])
    assert bob.get(f"/api/v1/jobs/{secret.id}/").status_code == 404
    assert bob.get(f"/api/v1/jobs/{secret.id}/logs/").status_code == 404
    assert bob.get("/api/v1/jobs/").json()["count"] == 0
    assert client_for(team["ada"]).get(f"/api/v1/jobs/{secret.id}/").status_code == 200  # tenant admins see all
    shared = client_for(team["alice"]).post(f"/api/v1/jobs/{secret.id}/share/", {"username": "bob"}, format="json")
    assert shared.json()["results"] == [{"username": "bob", "access": "view"}]
    assert bob.get(f"/api/v1/jobs/{secret.id}/").status_code == 200
    assert bob.get("/api/v1/jobs/").json()["count"] == 1


def test_researchers_control_only_their_own_jobs_unless_given_control(team, django_capture_on_commit_callbacks):
    running = job(team["alice"], status=Status.PROCESSING)
    bob = client_for(team["bob"])
    refused = bob.post(f"/api/v1/jobs/{running.id}/halt/")
    assert refused.status_code == 403 and "owner" in refused.json()["detail"]
    client_for(team["alice"]).post(f"/api/v1/jobs/{running.id}/share/", {"username": "bob", "access": "control"},
                                   format="json")
    with django_capture_on_commit_callbacks(execute=False):
        assert bob.post(f"/api/v1/jobs/{running.id}/halt/").status_code == 202
    client_for(team["alice"]).delete(f"/api/v1/jobs/{running.id}/share/bob/")
    assert bob.post(f"/api/v1/jobs/{running.id}/terminate/").status_code == 403


def test_sharing_refuses_viewers_for_control_outsiders_and_non_owners(team):
    theirs = job(team["alice"], private=True)
    alice = client_for(team["alice"])
    viewer = alice.post(f"/api/v1/jobs/{theirs.id}/share/", {"username": "vera", "access": "control"}, format="json")
    assert viewer.status_code == 400 and "viewer" in viewer.json()["detail"]
    member("team-b", "mallory")
    outsider = alice.post(f"/api/v1/jobs/{theirs.id}/share/", {"username": "mallory"}, format="json")
    assert outsider.status_code == 400 and outsider.json()["field"] == "username"
    public = job(team["alice"])
    assert client_for(team["bob"]).post(f"/api/v1/jobs/{public.id}/share/", {"username": "vera"},
                                        format="json").status_code == 403


def test_an_owner_made_a_viewer_no_longer_shares_their_job(team):
    """Sharing is the owner's as a researcher: demoted to viewer, they can neither hand control of the
    job to others nor take shares back."""
    theirs = job(team["alice"], private=True)
    alice = client_for(team["alice"])
    assert alice.post(f"/api/v1/jobs/{theirs.id}/share/", {"username": "vera"}, format="json").status_code == 200
    team["alice"].role = "viewer"
    team["alice"].save()
    given = alice.post(f"/api/v1/jobs/{theirs.id}/share/", {"username": "bob", "access": "control"}, format="json")
    assert given.status_code == 403 and "researcher" in given.json()["detail"]
    assert alice.delete(f"/api/v1/jobs/{theirs.id}/share/vera/").status_code == 403
    assert client_for(team["ada"]).get(f"/api/v1/jobs/{theirs.id}/share/").json()["results"] == [
        {"username": "vera", "access": "view"}]


def test_viewers_see_public_jobs_but_never_control_them(team):
    public = job(team["alice"], status=Status.PROCESSING)
    vera = client_for(team["vera"])
    assert vera.get(f"/api/v1/jobs/{public.id}/").status_code == 200
    assert vera.post(f"/api/v1/jobs/{public.id}/halt/").json()["detail"] == "viewers cannot halt jobs"
