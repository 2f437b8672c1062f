"""Runs people can vary, on the pages: the job page shows the run's command, manifest (credentials
redacted) and hyperparameters; Clone opens the submit form filled in from a job of the member's own
tenant; the jobs list shows chosen hyperparameter and metric columns."""
import html
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from jobs.datastores import REDACTED
from jobs.listing import ListingError
from jobs.models import Job, MetricPoint
from jobs.runs import Columns
from tests.support.builders import job, logged_in, member, tar_gz, upload

pytestmark = pytest.mark.django_db

SECRET = "s3cr3t-Pa55"
WITH_STORE = f"""name: with-data
framework: {{name: custom, command: sh run.sh --lr 0.1}}
data_stores:
  - id: lake
    type: s3_datastore
    training_data: {{container: data-bucket}}
    connection:
      auth_url: http://127.0.0.1:9
      user_name: AKIDEXAMPLE
      password: '{SECRET}'
"""


@pytest.fixture
def alice():
    return member("team-a", "alice")


def submitted(client, manifest=WITH_STORE):
    """A job submitted through the submit form, with its code archive."""
    response = client.post("/submit/", {"manifest": manifest,
                                        "code": upload(tar_gz({"run.sh": b"echo hi\n"}))})
    assert response.status_code == 302, response.content.decode()[-2000:]
    return Job.objects.get(pk=response["Location"].split("/")[2])


def text_of(response):
    return html.unescape(response.content.decode())


# --- the job page ----------------------------------------------------------------------------------
def test_it_shows_the_command_and_the_manifest_without_its_credentials(alice):
    client = logged_in(alice)
    mine = submitted(client)
    page = text_of(client.get(f"/jobs/{mine.id}/"))
    assert 'data-testid="run-command">sh run.sh --lr 0.1</code>' in page
    assert "training_data: {container: data-bucket}" in page and "auth_url: http://127.0.0.1:9" in page
    assert SECRET not in page and "AKIDEXAMPLE" not in page and f'password: "{REDACTED}"' in page


def test_it_redacts_a_credential_stored_in_the_clear_too(alice):
    old = job(alice, manifest_yaml=WITH_STORE)  # a row written before redaction, or edited by hand
    page = text_of(logged_in(alice).get(f"/jobs/{old.id}/"))
    assert SECRET not in page and f'password: "{REDACTED}"' in page


def test_it_shows_a_trials_hyperparameters_and_links_its_experiment(alice):
    trial = job(alice)
    trial.runtime = dict(trial.runtime, hyperparameters={"lr": 0.001, "width": 64, "optimizer": "adam"},
                         experiment={"id": "exp-7", "trial": 3})
    trial.save()
    page = text_of(logged_in(alice).get(f"/jobs/{trial.id}/"))
    assert '<li data-name="lr"><span class="muted">lr</span> <code>0.001</code></li>' in page
    assert page.index('data-name="lr"') < page.index('data-name="optimizer"') < page.index('data-name="width"')
    assert ('<a class="small" data-testid="experiment-link" href="/experiments/exp-7/">'
            'trial 3 of experiment exp-7</a>') in page


def test_a_job_without_hyperparameters_shows_none(alice):
    page = text_of(logged_in(alice).get(f"/jobs/{job(alice).id}/"))
    assert 'data-testid="run-command">sh run.sh</code>' in page
    assert 'data-testid="hyperparameters"' not in page and 'data-testid="experiment-link"' not in page


def test_a_long_manifest_starts_folded(alice):
    short = job(alice)
    long = job(alice, manifest_yaml=short.manifest_yaml + "".join(f"# note {i}\n" for i in range(40)))
    client = logged_in(alice)
    assert '<details class="run-manifest" data-testid="manifest" open>' in text_of(client.get(f"/jobs/{short.id}/"))
    folded = text_of(client.get(f"/jobs/{long.id}/"))
    assert '<details class="run-manifest" data-testid="manifest" >' in folded and "# note 39" in folded


def test_only_members_who_may_submit_see_clone(alice):
    mine = job(alice)
    assert 'data-testid="clone"' in text_of(logged_in(alice).get(f"/jobs/{mine.id}/"))
    viewer = member("team-a", "victor", role="viewer")
    assert 'data-testid="clone"' not in text_of(logged_in(viewer).get(f"/jobs/{mine.id}/"))


# --- clone -----------------------------------------------------------------------------------------
def test_clone_fills_the_submit_form_with_the_jobs_redacted_manifest(alice):
    client = logged_in(alice)
    source = submitted(client)
    response = client.get("/submit/", {"clone": source.id})
    assert response.status_code == 200
    assert response.context["manifest_text"] == source.manifest_yaml
    page = text_of(response)
    assert SECRET not in page and 'data-testid="clone-redacted"' in page
    assert f'<input type="hidden" name="clone" value="{source.id}">' in page
    assert 'data-testid="reuse-code" checked' in page


def test_a_clone_reusing_the_code_runs_the_same_archive(alice):
    client = logged_in(alice)
    source = submitted(client, manifest="name: first\nframework: {name: custom, command: sh run.sh}\n")
    response = client.post("/submit/", {"manifest": "name: second\nframework: {name: custom, command: sh run.sh 2}\n",
                                        "clone": source.id, "reuse_code": "1"})
    assert response.status_code == 302, text_of(response)[-2000:]
    clone = Job.objects.get(name="second")
    assert (clone.code_sha256, clone.code_bytes) == (source.code_sha256, source.code_bytes)
    assert clone.runtime["command"] == "sh run.sh 2"


def test_a_clone_without_reusing_the_code_asks_for_it(alice):
    client = logged_in(alice)
    source = submitted(client, manifest="name: first\nframework: {name: custom, command: sh run.sh}\n")
    response = client.post("/submit/", {"manifest": "name: second\nframework: {name: custom, command: sh run.sh}\n",
                                        "clone": source.id})
    assert response.status_code == 400 and "a code archive (zip or tar.gz) is required" in text_of(response)
    assert 'data-testid="reuse-code" >' in text_of(response)  # left unticked, as it was sent
    assert Job.objects.count() == 1


def test_a_clone_says_when_the_code_is_no_longer_stored(alice):
    source = job(alice)  # a row with no folder: its code is gone
    client = logged_in(alice)
    page = text_of(client.get("/submit/", {"clone": source.id}))
    assert 'data-testid="clone-code-gone"' in page and 'data-testid="reuse-code"' not in page
    refused = client.post("/submit/", {"manifest": source.manifest_yaml, "clone": source.id, "reuse_code": "1"})
    assert refused.status_code == 400 and "code is no longer stored" in text_of(refused)


def test_another_tenants_job_cannot_be_cloned(alice):
    theirs = submitted(logged_in(member("team-b", "bob")))
    client = logged_in(alice)
    assert client.get("/submit/", {"clone": theirs.id}).status_code == 404
    stolen = client.post("/submit/", {"manifest": "name: x\nframework: {name: custom, command: sh run.sh}\n",
                                      "clone": theirs.id, "reuse_code": "1"})
    assert stolen.status_code == 404 and Job.objects.filter(tenant=alice.tenant).count() == 0


def test_a_private_job_of_someone_else_cannot_be_cloned(alice):
    hidden = job(member("team-a", "carol"), private=True)
    assert logged_in(alice).get("/submit/", {"clone": hidden.id}).status_code == 404


# --- the jobs list's columns -----------------------------------------------------------------------
def trials(membership, count):
    base = timezone.now()
    made = []
    for i in range(count):
        trial = job(membership, name=f"trial-{i}", created_at=base - timedelta(seconds=i))
        trial.runtime = dict(trial.runtime, hyperparameters={"lr": 10 ** -(i + 1), "width": 32 * (i + 1)})
        trial.save()
        made.append(trial)
    return made


def test_the_list_shows_chosen_hyperparameter_and_metric_columns(alice):
    first, second, third = trials(alice, 3)
    now = timezone.now()
    MetricPoint.objects.bulk_create([
        MetricPoint(job=first, name="val_acc", step=1, value=0.5, time=now),
        MetricPoint(job=first, name="val_acc", step=2, value=0.75, time=now),  # the latest
        MetricPoint(job=first, name="loss", step=2, value=9.0, time=now),
        MetricPoint(job=second, name="val_acc", step=1, value=0.625, time=now)])
    response = logged_in(alice).get("/", {"hp": "lr,width", "metric": "val_acc"})
    page = text_of(response)
    assert [h for h in ("lr", "width", "val_acc") if f'title="hyperparameter">{h}<' in page
            or f'title="latest value of the metric">{h}<' in page] == ["lr", "width", "val_acc"]
    cells = {row.name: row.extra_cells for row in response.context["page"].rows}
    assert cells == {"trial-0": ["0.1", "32", "0.75"], "trial-1": ["0.01", "64", "0.625"],
                     "trial-2": ["0.001", "96", "—"]}
    assert 'value="lr, width"' in page and 'value="val_acc"' in page  # the picker shows the choice


def test_the_metric_columns_cost_one_query_for_the_whole_page(alice):
    jobs = trials(alice, 3)
    now = timezone.now()
    MetricPoint.objects.bulk_create([MetricPoint(job=j, name=name, step=s, value=s, time=now)
                                     for j in jobs for name in ("a", "b") for s in range(5)])
    client = logged_in(alice)
    client.get("/")  # the session and the like, read once
    with CaptureQueriesContext(connection) as plain:
        client.get("/")
    with CaptureQueriesContext(connection) as chosen:
        assert client.get("/", {"hp": "lr", "metric": "a,b"}).context["page"].rows[0].extra_cells == ["0.1", "4", "4"]
    assert len(chosen) == len(plain) + 1
    metric_reads = [q["sql"] for q in chosen if "metricpoint" in q["sql"].lower()]
    assert len(metric_reads) == 1


def test_a_job_list_without_columns_loads_no_runtime(alice):
    trials(alice, 2)
    response = logged_in(alice).get("/")
    row = response.context["page"].rows[0]
    assert "runtime" in row.get_deferred_fields() and row.extra_cells == []


def test_too_many_columns_is_a_named_error(alice):
    response = logged_in(alice).get("/", {"metric": ",".join(f"m{i}" for i in range(9))})
    assert response.status_code == 400 and "metric: at most 8 names; more given" in text_of(response)


def test_it_refuses_column_names_at_the_first_past_the_cap():
    def names_without_end(key):  # each further name read costs the page time: reading many is the fault
        for i in range(1000):
            yield f"m{i}"
        raise AssertionError(f"read {key} names far past the cap")

    with pytest.raises(ListingError, match="hp: at most 8 names"):
        Columns.from_params(SimpleNamespace(getlist=names_without_end))


def test_an_address_of_thousands_of_column_names_is_refused_at_once(alice):
    client, names = logged_in(alice), ",".join(f"h{i}" for i in range(50_000))
    started = time.monotonic()
    response = client.get("/", {"hp": names})
    assert response.status_code == 400 and "hp: at most 8 names" in text_of(response)
    assert time.monotonic() - started < 5  # generous: a search per name made this grow with its square


def test_an_outsider_sees_no_column_of_the_tenants_jobs(alice):
    trials(alice, 1)
    outsider = logged_in(member("team-b", "mallory")).get("/", {"hp": "lr", "metric": "val_acc"})
    assert outsider.context["page"].rows == []
