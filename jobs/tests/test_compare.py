"""Compare runs (jobs.compare): the REST endpoint the compare page and `trainyard compare` read, and the page."""
from datetime import timedelta

import pytest
from django.core.cache import cache
from django.utils import timezone

from jobs import compare, sharing
from jobs.models import MetricPoint
from tenants import throttling
from tests.support.builders import client_for, job, logged_in, member

pytestmark = pytest.mark.django_db
URL = "/api/v1/jobs/compare/"


def manifest(command, learners=1, memory="1GiB"):
    return f"name: sweep\nlearners: {learners}\ncpus: 1\nmemory: {memory}\nframework: {{name: custom, command: {command}}}\n"


def sweep_job(membership, name, command, *, losses=(), learners=1, **fields):
    row = job(membership, name=name, learners=learners, manifest_yaml=manifest(command, learners), **fields)
    report(row, "loss", losses)
    return row


def report(row, name, values, *, attempt=1, learner=0, first_step=1):
    now = timezone.now()
    MetricPoint.objects.bulk_create([
        MetricPoint(job=row, attempt=attempt, learner=learner, name=name, step=first_step + i, value=value,
                    time=now + timedelta(milliseconds=i)) for i, value in enumerate(values)])


@pytest.fixture
def alice():
    return member("team-a", "alice")


@pytest.fixture
def sweep(alice):
    return [sweep_job(alice, f"lr-{lr}", f"python train.py --lr {lr} --epochs 3 --batch-size 32",
                      losses=[1.0, 0.5, loss]) for lr, loss in (("0.1", 0.3), ("0.03", 0.2), ("0.01", 0.4))]


def get(client, ids):
    return client.get(URL, {"ids": ",".join(ids)})


def test_it_compares_jobs_with_one_series_per_job_and_only_the_rows_that_differ(alice, sweep):
    for row in sweep[:2]:
        report(row, "val_acc", [0.7, 0.9])
    response = get(client_for(alice), [j.id for j in sweep])
    assert response.status_code == 200, response.json()
    body = response.json()
    assert [j["id"] for j in body["jobs"]] == [j.id for j in sweep]
    rows = {row["key"]: row for row in body["rows"]}
    assert rows["learning_rate"]["label"] == "learning rate"
    assert rows["learning_rate"]["values"] == ["0.1", "0.03", "0.01"]
    assert set(rows) == {"learning_rate", "command"}  # epochs, batch, framework, resources: all the same
    same = {fact["key"]: fact["value"] for fact in body["same"]}
    assert same["batch_size"] == "32" and same["flag:epochs"] == "3" and same["learners"] == "1"
    metrics = {m["name"]: m for m in body["metrics"]}
    assert [m["name"] for m in body["metrics"]] == ["loss", "val_acc"]  # loss-like first
    assert [s["job"] for s in metrics["loss"]["series"]] == [j.id for j in sweep]
    assert metrics["loss"]["series"][0]["points"] == [[1, 1.0], [2, 0.5], [3, 0.3]]
    assert metrics["loss"]["final"] == [0.3, 0.2, 0.4]
    assert metrics["val_acc"]["final"] == [0.9, 0.9, None] and len(metrics["val_acc"]["series"]) == 2


def test_it_lines_up_lr_and_batch_however_the_command_spells_them(alice):
    a = sweep_job(alice, "a", "python train.py --learning-rate=0.5 --batch_size 64 --amp")
    b = sweep_job(alice, "b", "EPOCHS=4 python train.py --lr 0.5 --bs 128", learners=2)
    rows = {row["key"]: row["values"] for row in get(client_for(alice), [a.id, b.id]).json()["rows"]}
    assert "learning_rate" not in rows  # 0.5 both times
    assert rows["batch_size"] == ["64", "128"]
    assert rows["learners"] == ["1", "2"]
    assert rows["flag:amp"] == ["true", ""] and rows["env:EPOCHS"] == ["", "4"]
    body = get(client_for(alice), [a.id, b.id]).json()  # rows in table order, whichever job has them
    assert [row["key"] for row in body["rows"]] == ["learners", "batch_size", "flag:amp", "env:EPOCHS", "command"]


def test_an_elastic_manifests_batch_and_range_are_rows_too(alice):
    fixed = sweep_job(alice, "fixed", "python train.py --batch-size 64")
    elastic = job(alice, name="elastic", manifest={"elastic": {"min_learners": 1, "max_learners": 4, "batch_size": {
        "global": 256, "min": 64, "max": 512}}}, manifest_yaml=manifest("python train.py"))
    rows = {row["key"]: row["values"] for row in get(client_for(alice), [fixed.id, elastic.id]).json()["rows"]}
    assert rows["batch_size"] == ["64", "256"] and rows["elastic"] == ["", "1–4 learners, lr linear"]


def test_a_resumed_attempt_continues_the_line_and_wins_the_steps_it_repeats(alice):
    resumed = sweep_job(alice, "resumed", "python train.py", losses=[1.0, 0.8, 0.6])
    report(resumed, "loss", [0.7, 0.5], attempt=2, first_step=3)
    report(resumed, "loss", [9.0, 9.0, 9.0, 9.0], learner=1)  # another learner's copy: not this job's line
    other = sweep_job(alice, "other", "python train.py", losses=[1.0])
    loss = get(client_for(alice), [resumed.id, other.id]).json()["metrics"][0]
    assert loss["series"][0]["points"] == [[1, 1.0], [2, 0.8], [3, 0.7], [4, 0.5]]
    assert loss["final"] == [0.5, 1.0]


def test_it_thins_long_series_to_the_point_cap_keeping_the_last(alice, monkeypatch):
    monkeypatch.setattr(compare, "MAX_POINTS", 50)
    long = sweep_job(alice, "long", "python train.py", losses=[float(i) for i in range(1000)])
    short = sweep_job(alice, "short", "python train.py", losses=[1.0, 2.0])
    series = get(client_for(alice), [long.id, short.id]).json()["metrics"][0]["series"]
    assert len(series[0]["points"]) == 50 and series[0]["thinned"] and series[0]["count"] == 1000
    assert series[0]["points"][0] == [1, 0.0] and series[0]["points"][-1] == [1000, 999.0]
    assert not series[1]["thinned"]


def test_a_very_long_line_is_averaged_over_step_buckets_by_the_database(alice, monkeypatch):
    monkeypatch.setattr(compare, "AVERAGE_ABOVE", 100)
    monkeypatch.setattr(compare, "MAX_POINTS", 10)
    long = sweep_job(alice, "long", "python train.py", losses=[float(i) for i in range(1, 1001)])  # step i holds i
    report(long, "loss", [7.0], attempt=2, first_step=1000)  # a resumed attempt's last word on the last step
    short = sweep_job(alice, "short", "python train.py", losses=[1.0, 2.0])
    metric = get(client_for(alice), [long.id, short.id]).json()["metrics"][0]
    line = metric["series"][0]
    assert line["averaged"] and line["thinned"] and line["count"] == 1001
    assert len(line["points"]) == 10
    assert line["points"][0] == [100, 50.5]  # steps 1..100 hold 1..100
    assert line["points"][-1][0] == 1000
    assert metric["final"] == [7.0, 2.0]
    assert not metric["series"][1]["averaged"]


def test_steps_across_the_whole_range_a_learner_may_send_are_averaged(alice, monkeypatch):
    monkeypatch.setattr(compare, "AVERAGE_ABOVE", 3)
    monkeypatch.setattr(compare, "MAX_POINTS", 2)
    wide = sweep_job(alice, "wide", "python train.py", losses=[1.0, 2.0])  # steps 1 and 2
    report(wide, "loss", [3.0], first_step=-10)
    report(wide, "loss", [4.0], first_step=2**63 - 1)  # step - low overflows a bigint
    other = sweep_job(alice, "other", "python train.py", losses=[1.0])
    response = get(client_for(alice), [wide.id, other.id])
    assert response.status_code == 200
    assert response.json()["metrics"][0]["series"][0]["points"] == [[2, 2.0], [2**63 - 1, 4.0]]


def test_points_without_a_step_line_up_in_the_order_they_arrived(alice):
    unstepped = job(alice, name="unstepped", manifest_yaml=manifest("python train.py"))
    now = timezone.now()
    MetricPoint.objects.bulk_create([MetricPoint(job=unstepped, attempt=attempt, name="loss", step=None, value=value,
                                                 time=now) for attempt, value in ((1, 0.9), (1, 0.7), (2, 0.4))])
    other = sweep_job(alice, "other", "python train.py", losses=[1.0])
    loss = get(client_for(alice), [unstepped.id, other.id]).json()["metrics"][0]
    assert loss["series"][0]["points"] == [[0, 0.9], [1, 0.7], [2, 0.4]] and loss["final"] == [0.4, 1.0]


@pytest.fixture
def many_long_lines(alice, monkeypatch):
    """Eight jobs of 24 metrics of 50 points each, and an answer's budget of 5 points a line."""
    monkeypatch.setattr(compare, "MAX_ANSWER_POINTS", 8 * 24 * 5, raising=False)
    rows = [job(alice, name=f"run-{i}", manifest_yaml=manifest(f"python train.py --seed {i}")) for i in range(8)]
    now = timezone.now()
    MetricPoint.objects.bulk_create([
        MetricPoint(job=row, name=f"m{metric:02}", step=step, value=float(step), time=now)
        for row in rows for metric in range(24) for step in range(1, 51)])
    return rows


def test_all_lines_share_one_point_budget_read_in_a_few_queries_per_job(alice, many_long_lines,
                                                                        django_assert_max_num_queries):
    client = client_for(alice)
    with django_assert_max_num_queries(2 * len(many_long_lines) + 10):  # not a few per line
        body = get(client, [row.id for row in many_long_lines]).json()
    lines = [line for metric in body["metrics"] for line in metric["series"]]
    assert len(lines) == 8 * 24 and sum(len(line["points"]) for line in lines) <= 8 * 24 * 5
    assert all(line["points"][0] == [1, 1.0] and line["points"][-1] == [50, 50.0] and line["thinned"]
               for line in lines)
    assert body["limits"]["max_points"] == 5 and body["metrics"][0]["final"] == [50.0] * 8


def test_the_page_reads_only_the_final_values_its_table_shows(alice, many_long_lines, django_assert_max_num_queries):
    client = logged_in(alice)
    with django_assert_max_num_queries(2 * len(many_long_lines) + 15):
        response = client.get("/jobs/compare/", {"ids": ",".join(row.id for row in many_long_lines)})
    assert response.status_code == 200 and response.content.decode().count('data-testid="final-row"') == 24
    assert all(metric["series"] == [] for metric in response.context["comparison"].metrics)  # compare.js reads them


def test_it_charts_at_most_the_metric_cap_and_names_the_rest(alice, sweep, monkeypatch):
    monkeypatch.setattr(compare, "MAX_METRICS", 2)
    for name in ("acc", "zeta"):
        report(sweep[0], name, [1.0])
    body = get(client_for(alice), [j.id for j in sweep]).json()
    assert [m["name"] for m in body["metrics"]] == ["loss", "acc"] and body["omitted_metrics"] == ["zeta"]


@pytest.mark.parametrize("ids, words", [
    (None, "give 2 to 8 job ids"),
    ("", "give 2 to 8 job ids"),
    ("training-a", "(got 1)"),
    (",".join(f"training-{i}" for i in range(9)), "(got 9)"),
    (",".join(["x/"] * 20000), "(got 20000)"),  # too many is said first, before each id is looked at
    ("training-a,../etc/passwd", "is not a job id"),
    ("training-a,training-b,training-a", "training-a is given twice"),
])
def test_it_refuses_too_few_too_many_or_malformed_ids_with_400_naming_ids(alice, ids, words):
    response = client_for(alice).get(URL, {} if ids is None else {"ids": ids})
    assert response.status_code == 400, response.json()
    assert response.json()["field"] == "ids" and words in response.json()["detail"]


def test_another_tenants_job_is_404_and_never_named(alice, sweep):
    mallory = member("team-b", "mallory")
    theirs = sweep_job(mallory, "secret-sweep", "python train.py --lr 9")
    response = get(client_for(alice), [sweep[0].id, theirs.id])
    assert response.status_code == 404
    assert "team-b" not in response.content.decode() and "secret" not in response.content.decode()
    # ...exactly as an id that does not exist at all
    assert get(client_for(alice), [sweep[0].id, "training-nosuchjob"]).status_code == 404
    # and from the other side: mallory cannot see alice's jobs either
    assert get(client_for(mallory), [theirs.id, sweep[1].id]).status_code == 404


def test_a_tenant_runs_a_bounded_number_of_comparisons_at_once_and_others_are_not_held(alice, sweep):
    # At the limits one comparison keeps the database reading for many seconds: a tenant that asks for
    # many at once waits for its own, never for another tenant's room.
    ids = [job.id for job in sweep[:2]]
    mallory = member("team-b", "mallory")
    theirs = [sweep_job(mallory, f"b-{n}", "python train.py", losses=[1.0]).id for n in range(2)]
    holds = [throttling.slot(throttling.COMPARISONS, alice.tenant_id) for _ in range(throttling.COMPARISONS.limit)]
    assert all(hold.__enter__() for hold in holds)
    try:
        busy = get(client_for(alice), ids)
        assert busy.status_code == 429 and busy["Retry-After"] == "3" and "running" in busy.json()["detail"]
        assert logged_in(alice).get("/jobs/compare/", {"ids": ",".join(ids)}).status_code == 429
        assert get(client_for(mallory), theirs).status_code == 200
    finally:
        for hold in holds:
            hold.__exit__(None, None, None)
    assert get(client_for(alice), ids).status_code == 200


def test_a_renewed_slot_is_kept_past_its_hold_while_its_block_runs():
    import time
    rule = throttling.AtOnce("renewed-test", limit=1, hold_s=1, renewed=True)
    with throttling.slot(rule, "t") as first:
        assert first
        time.sleep(2.2)  # twice its hold
        with throttling.slot(rule, "t") as second:
            assert not second
    with throttling.slot(rule, "t") as after:
        assert after


def test_a_comparisons_slot_is_kept_while_it_runs(monkeypatch, alice, sweep):
    import dataclasses
    import time
    from jobs import compare
    monkeypatch.setattr(throttling, "COMPARISONS", dataclasses.replace(throttling.COMPARISONS, limit=1, hold_s=1))
    real = compare.metric_series
    seen = []

    def slow(*args, **kwargs):  # the lines of large jobs: longer than the slot's hold
        time.sleep(2.2)
        with throttling.slot(throttling.COMPARISONS, alice.tenant_id) as another:
            seen.append(another)
        return real(*args, **kwargs)
    monkeypatch.setattr(compare, "metric_series", slow)
    assert get(client_for(alice), [job.id for job in sweep]).status_code == 200
    assert seen == [False]


def test_a_comparison_that_outran_its_slot_frees_only_a_slot_it_still_holds():
    rule = throttling.AtOnce("compare-test", limit=1, hold_s=60)
    first = throttling.slot(rule, "t")
    assert first.__enter__()
    cache.delete(throttling._key(rule, ("t", 0), "slot"))  # its slot timed out while it ran
    with throttling.slot(rule, "t") as second:
        assert second
        first.__exit__(None, None, None)  # ends now: the slot is the second's
        with throttling.slot(rule, "t") as third:
            assert not third


def test_a_private_job_counts_only_for_those_who_may_see_it(alice, sweep):
    bob = member("team-a", "bob")
    private = sweep_job(bob, "bobs-private", "python train.py --lr 1", private=True)
    ids = [sweep[0].id, private.id]
    assert get(client_for(alice), ids).status_code == 404
    sharing.share(private, "alice", "view")
    assert get(client_for(alice), ids).status_code == 200
    assert get(client_for(member("team-a", "admin", role="admin")), ids).status_code == 200


def test_the_page_renders_the_differences_and_a_shareable_address(alice, sweep):
    ids = ",".join(j.id for j in sweep)
    response = logged_in(alice).get("/jobs/compare/", {"ids": ids})
    assert response.status_code == 200
    html = response.content.decode()
    assert html.count('data-testid="diff-row"') == 2 and 'data-key="learning_rate"' in html
    assert html.count('data-testid="final-row"') == 1 and ">0.2</td>" in html
    assert f'data-ids="{ids}"' in html


def test_the_page_takes_the_ids_a_plain_form_sends(alice, sweep):
    response = logged_in(alice).get("/jobs/compare/", {"ids": [j.id for j in sweep]})  # ?ids=a&ids=b&ids=c
    assert response.status_code == 200 and response.context["comparison"].jobs == sweep


def test_the_page_says_what_is_wrong_with_the_ids_and_hides_other_tenants(alice, sweep):
    client = logged_in(alice)
    bad = client.get("/jobs/compare/", {"ids": sweep[0].id})
    assert bad.status_code == 400 and "give 2 to 8 job ids" in bad.content.decode()
    theirs = sweep_job(member("team-b", "mallory"), "secret", "python train.py")
    assert client.get("/jobs/compare/", {"ids": f"{sweep[0].id},{theirs.id}"}).status_code == 404


def test_the_jobs_page_offers_a_box_per_job_and_the_compare_button(alice, sweep):
    html = logged_in(alice).get("/").content.decode()
    assert html.count('data-testid="select-job"') == 3 and 'data-testid="compare"' in html
    assert 'form="compare-form"' in html and 'action="/jobs/compare/"' in html
    assert "{#" not in html and "comment %}" not in html  # template comments stay out of the page


@pytest.mark.django_db(transaction=True)
def test_the_cli_prints_the_table_of_differences_from_the_real_endpoint(live_server, monkeypatch, capsys):
    from tests.support.builders import token_for
    from trainyard import cli

    alice = member("team-a", "alice")
    sweep = [sweep_job(alice, f"lr-{lr}", f"python train.py --lr {lr} --epochs 3", losses=[1.0, loss])
             for lr, loss in (("0.1", 0.25), ("0.03", 0.125), ("0.01", 0.5))]
    monkeypatch.setenv("TRAINYARD_URL", live_server.url)
    monkeypatch.setenv("TRAINYARD_TOKEN", token_for(alice))
    monkeypatch.setenv("HOME", "/nonexistent")
    assert cli.main(["compare", *(j.id for j in sweep)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [j.id for j in sweep]
    table = {line.split("  ")[0].strip(): line.split()[-3:] for line in lines[1:]}
    assert table["name"] == ["lr-0.1", "lr-0.03", "lr-0.01"]
    assert table["learning rate"] == ["0.1", "0.03", "0.01"]
    assert table["final loss"] == ["0.25", "0.125", "0.5"]
    assert "command" not in table  # the learning rate row says how the commands differ
    assert lines[-1].startswith("same in all: framework custom") and "--epochs 3" in lines[-1]
    with capsys.disabled():  # shown with -s: what a person sees
        print("\n" + "\n".join(lines))

    assert cli.main(["compare", sweep[0].id]) == 1  # the server's rule, in its words
    assert "ids: give 2 to 8 job ids" in capsys.readouterr().err
    mallory = member("team-b", "mallory")
    assert cli.main(["compare", sweep[0].id, sweep_job(mallory, "x", "python train.py").id]) == 1
    err = capsys.readouterr().err
    assert "training-" in err and "team-b" not in err, err
