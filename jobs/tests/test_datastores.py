"""Data stores: transfers (local folders and a real S3-compatible server), credentials, redaction."""
import json

import pytest
from rest_framework.test import APIClient

from jobs import datastores, runtime, storage, transfers
from jobs.datastores import DataStoreError, LocalStore, Location, S3Store
from tests.support.builders import member, tar_gz, token_for, upload
from tests.support.s3_server import s3_server
from trainyard.manifest import parse_manifest
from jobs.models import Job, LogLine

SECRET = "s3cr3t-Pa55"

MANIFEST = f"""
name: with-data
framework: {{name: custom, command: sh run.sh}}
data_stores:
  - id: lake
    type: s3_datastore
    training_data: {{container: data-bucket/inputs}}
    training_results: {{container: results-bucket}}
    connection:
      auth_url: http://127.0.0.1:9
      user_name: AKIDEXAMPLE   # the access key id counts as a credential too
      password: '{SECRET}'
"""


# --- redaction -----------------------------------------------------------------------------------
def test_it_redacts_credentials_in_the_text_and_keeps_everything_else():
    redacted = datastores.redact_yaml(MANIFEST)
    assert SECRET not in redacted and "AKIDEXAMPLE" not in redacted
    assert "# the access key id counts as a credential too" in redacted  # comments and layout kept
    assert "auth_url: http://127.0.0.1:9" in redacted
    manifest = parse_manifest(redacted)  # still a valid manifest
    assert manifest.data_stores[0]["connection"]["password"] == datastores.REDACTED


@pytest.mark.parametrize("style", ["password: {s}", "password: '{s}'", 'password: "{s}"', "password: |\n        {s}"])
def test_it_redacts_however_the_secret_is_quoted(style):
    text = MANIFEST.replace(f"password: '{SECRET}'", style.format(s=SECRET))
    assert parse_manifest(text).data_stores[0]["connection"]["password"].strip() == SECRET
    assert SECRET not in datastores.redact_yaml(text)


def test_it_replaces_exactly_the_secret_after_text_of_several_bytes_a_character():
    # The node marks count characters, not bytes: "é✓" before the secret must not shift what is cut.
    text = MANIFEST.replace("name: with-data", "name: with-data\ndescription: données ✓✓ 日本").replace(
        "password: '{SECRET}'".format(SECRET=SECRET), f"password: '{SECRET}'  # é✓")
    redacted = datastores.redact_yaml(text)
    assert SECRET not in redacted
    assert f'password: "{datastores.REDACTED}"  # é✓' in redacted
    assert redacted.replace(f'"{datastores.REDACTED}"', "X") == text.replace(f"'{SECRET}'", "X").replace(
        "AKIDEXAMPLE", "X")


def test_it_redacts_the_parsed_mapping_and_reads_the_credentials():
    raw = parse_manifest(MANIFEST).raw
    assert datastores.credentials(raw) == {"lake": {"user_name": "AKIDEXAMPLE", "password": SECRET}}
    assert SECRET not in json.dumps(datastores.redact(raw))
    assert datastores.redact(raw)["data_stores"][0]["connection"]["auth_url"] == "http://127.0.0.1:9"


# --- sealing -------------------------------------------------------------------------------------
def test_sealed_credentials_are_encrypted_private_and_need_the_same_key(tmp_path):
    path = datastores.seal_credentials(tmp_path, {"lake": {"password": SECRET}}, keys="key-one")
    assert SECRET.encode() not in path.read_bytes()
    assert path.stat().st_mode & 0o777 == 0o600
    assert datastores.unseal_credentials(tmp_path, keys="key-one") == {"lake": {"password": SECRET}}
    with pytest.raises(DataStoreError, match="cannot be decrypted"):
        datastores.unseal_credentials(tmp_path, keys="key-two")
    datastores.delete_credentials(tmp_path)
    assert datastores.unseal_credentials(tmp_path, keys="key-one") == {}


def test_credentials_sealed_under_a_key_rotated_out_still_open_while_it_is_a_fallback(tmp_path):
    datastores.seal_credentials(tmp_path, {"lake": {"password": SECRET}}, keys="old-key")
    assert datastores.unseal_credentials(tmp_path, keys=["new-key", "old-key"]) == {"lake": {"password": SECRET}}
    with pytest.raises(DataStoreError, match="TRAINYARD_SECRET_KEY_FALLBACKS"):
        datastores.unseal_credentials(tmp_path, keys=["new-key"])


def test_nothing_is_sealed_without_credentials(tmp_path):
    assert datastores.seal_credentials(tmp_path, {}, keys="k") is None
    assert not list(tmp_path.iterdir())


# --- transfers between folders -------------------------------------------------------------------
def test_fetch_and_push_with_local_folders_report_progress(tmp_path):
    source = tmp_path / "store" / "inputs"
    (source / "sub").mkdir(parents=True)
    (source / "a.txt").write_text("a" * 3000)
    (source / "sub" / "b.txt").write_text("b")
    lines = []
    count, size = datastores.fetch(Location(LocalStore(tmp_path / "store", name="s"), "inputs", "store s"),
                                   tmp_path / "data", report=lines.append)
    assert (count, size) == (2, 3001)
    assert (tmp_path / "data" / "sub" / "b.txt").read_text() == "b"
    assert lines[0].startswith("[trainyard] downloading from store s: 0/2 files")
    assert lines[-1] == "[trainyard] downloading from store s: 2/2 files, 2.9 KiB/2.9 KiB (done)"

    results = tmp_path / "results"
    results.mkdir()
    (results / "model.bin").write_bytes(b"m")
    (results / ".tmp-partial").write_bytes(b"x")  # a half-written file is not uploaded
    datastores.push({"results": results, "missing": tmp_path / "nope"},
                    Location(LocalStore(tmp_path / "out", name="o"), "job-1", "store o"))
    assert [p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("*") if p.is_file()] == [
        "job-1/results/model.bin"]


@pytest.mark.parametrize("swapped", ["sub/model.bin", "sub"])
def test_a_file_or_folder_swapped_for_a_link_after_listing_is_left_out_not_followed(tmp_path, swapped):
    # A learner's process left running swaps a link to a platform file in for a listed one while the
    # upload begins (its first progress line).
    secret = tmp_path / "platform"
    secret.mkdir()
    (secret / "model.bin").write_bytes(b"SECRET")
    results = tmp_path / "results"
    (results / "sub").mkdir(parents=True)
    (results / "sub" / "model.bin").write_bytes(b"mine")
    lines = []

    def swap(line):
        if not lines:
            moved = results / swapped
            moved.rename(tmp_path / "aside")
            moved.symlink_to(secret / "model.bin" if swapped.endswith(".bin") else secret)
        lines.append(line)

    datastores.push({"results": results}, Location(LocalStore(tmp_path / "out", name="o"), "job-1", "store o"),
                    report=swap)
    assert not [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert lines[-1] == ("[trainyard] uploading to store o: 1 symbolic links or other entries that are not plain "
                         "files were left out (a link is never followed): 'results/sub/model.bin'")


def test_a_missing_local_folder_is_a_clear_error(tmp_path):
    with pytest.raises(DataStoreError, match="folder .* does not exist"):
        datastores.fetch(Location(LocalStore(tmp_path, name="s"), "nope", "s"), tmp_path / "data")


def test_fetch_refuses_keys_that_would_escape_data_dir(tmp_path):
    class Evil(LocalStore):
        def list(self, prefix=""):
            yield datastores.StoredObject("../../escaped", 1)

    with pytest.raises(DataStoreError, match="outside DATA_DIR"):
        datastores.fetch(Location(Evil(tmp_path, name="e"), "", "e"), tmp_path / "data")


# --- a real S3-compatible server -----------------------------------------------------------------
@pytest.fixture(scope="module")
def s3():
    """yields (endpoint, id, secret) of a signature-checking S3 server with data-bucket and results-bucket."""
    data = {"inputs/train.csv": b"x,y\n1,2\n", "inputs/nested/more.csv": b"x,y\n3,4\n",
            "inputs-old/stale.csv": b"not this", "inputs": b"nor this"}
    with s3_server({"data-bucket": data, "results-bucket": {}}) as server:
        yield server


def test_s3_round_trip(s3, tmp_path):
    endpoint, key, secret = s3
    store = S3Store("data-bucket", endpoint=endpoint, access_key=key, secret_key=secret, name="lake")
    assert datastores.fetch(Location(store, "inputs", "lake"), tmp_path / "data") == (2, 16)
    assert (tmp_path / "data" / "nested" / "more.csv").read_bytes() == b"x,y\n3,4\n"
    assert sorted(p.name for p in (tmp_path / "data").rglob("*")) == ["more.csv", "nested", "train.csv"]  # the folder only
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "model.bin").write_bytes(b"weights")
    out = S3Store("results-bucket", endpoint=endpoint, access_key=key, secret_key=secret, name="lake")
    datastores.push({"results": tmp_path / "results"}, Location(out, "job-9", "lake"))
    assert [(o.key, o.size) for o in out.list("job-9")] == [("job-9/results/model.bin", 7)]


@pytest.mark.parametrize("change, words", [
    ({"secret_key": "wrong"}, "refused the credentials (SignatureDoesNotMatch)"),
    ({"access_key": "AKIANOSUCHKEY000"}, "refused the credentials (InvalidAccessKeyId)"),
    ({"bucket": "no-such-bucket"}, "the bucket does not exist (NoSuchBucket)"),
])
def test_s3_errors_are_clear_and_never_show_the_secret(s3, tmp_path, change, words):
    endpoint, key, secret = s3
    values = dict(bucket="data-bucket", access_key=key, secret_key=secret)
    values.update(change)
    store = S3Store(values.pop("bucket"), endpoint=endpoint, name="lake", **values)
    with pytest.raises(DataStoreError) as error:
        datastores.fetch(Location(store, "inputs", "lake"), tmp_path / "data")
    assert words in str(error.value) and "data store 'lake'" in str(error.value)
    assert secret not in str(error.value)


def test_an_unreachable_endpoint_fails_within_seconds(tmp_path):
    import time
    from portal.runner import free_port
    store = S3Store("b", endpoint=f"http://127.0.0.1:{free_port()}", access_key="a", secret_key="b", name="lake")
    started = time.monotonic()
    with pytest.raises(DataStoreError, match="data store 'lake'.*Could not connect"):
        datastores.fetch(Location(store, "", "lake"), tmp_path / "data")
    assert time.monotonic() - started < 30


def test_platform_storage_urls():
    assert isinstance(datastores.platform_store("file:///srv/trainyard").store, LocalStore)
    s3_location = datastores.platform_store("s3://artifacts/trainyard")
    assert (s3_location.store.bucket, s3_location.prefix) == ("artifacts", "trainyard")
    with pytest.raises(DataStoreError, match="names no bucket"):
        datastores.platform_store("s3:///x")
    with pytest.raises(DataStoreError, match="use file:///path or s3://bucket/prefix"):
        datastores.platform_store("ftp://x")


# --- the platform side: submission, download, storing, the end -----------------------------------


def submit(membership, manifest):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token_for(membership)}")
    return client.post("/api/v1/jobs/", {"manifest": upload(manifest.encode(), "manifest.yml"),
                                         "code": upload(tar_gz({"run.sh": b"echo hi\n"}))}, format="multipart")


@pytest.mark.django_db
def test_submission_stores_no_credential_and_the_api_shows_none(settings):
    alice = member()
    response = submit(alice, MANIFEST)
    assert response.status_code == 201, response.content
    answer = response.content.decode()  # the submission's own answer, not read back from the row
    assert SECRET not in answer and "AKIDEXAMPLE" not in answer and datastores.REDACTED in answer
    job = Job.objects.get(pk=response.json()["id"])
    assert SECRET not in job.manifest_yaml and SECRET not in json.dumps(job.manifest)
    folder = storage.job_dir(job.tenant.slug, job.id)
    assert datastores.unseal_credentials(folder, keys=settings.SECRET_KEY) == {
        "lake": {"user_name": "AKIDEXAMPLE", "password": SECRET}}
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token_for(alice)}")
    shown = client.get(f"/api/v1/jobs/{job.id}/").content.decode()
    assert SECRET not in shown and "AKIDEXAMPLE" not in shown and datastores.REDACTED in shown


@pytest.mark.django_db
def test_an_older_row_with_a_clear_text_secret_is_still_redacted_in_the_api():
    from tests.support.builders import job as make_job
    alice = member()
    row = make_job(alice, manifest=parse_manifest(MANIFEST).raw, manifest_yaml=MANIFEST)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token_for(alice)}")
    assert SECRET not in client.get(f"/api/v1/jobs/{row.id}/").content.decode()


LOCAL_JOB = """
name: local-data
framework: {name: custom, command: sh run.sh}
data_stores:
  - id: shelf
    type: local
    training_data: {container: digits}
    training_results: {container: trained}
"""


def pending_local_job(membership, data_root, files, manifest=LOCAL_JOB):
    """(a job of `manifest` admitted to PENDING, its tenant's `digits` shelf holding {name: bytes})."""
    from jobs.models import Status
    from jobs.states import transition
    shelf = datastores.local_root(data_root, membership.tenant.slug) / "digits"
    shelf.mkdir(parents=True)
    for name, content in files.items():
        (shelf / name).write_bytes(content)
    job = Job.objects.get(pk=submit(membership, manifest).json()["id"])
    transition(job.id, Status.PENDING, actor="test")
    job.refresh_from_db()
    return job, shelf


@pytest.mark.django_db(transaction=True)
def test_a_local_store_is_downloaded_with_progress_in_the_log_and_results_are_stored(settings):
    from jobs.models import Status
    alice = member()
    job, shelf = pending_local_job(alice, settings.DATA_DIR, {"train.csv": b"1,2\n"})
    assert transfers.fetch_training_data(job) is True
    folder = storage.job_dir(job.tenant.slug, job.id)
    assert (folder / "data" / "train.csv").read_text() == "1,2\n"
    job.refresh_from_db()
    assert job.status == Status.DOWNLOADING
    lines = list(LogLine.objects.filter(job=job).order_by("seq").values_list("stream", "line"))
    assert lines[-1] == ("system", "[trainyard] downloading from data store 'shelf' (folder digits): 1/1 files, "
                                   "4 B/4 B (done)")
    (shelf / "train.csv").write_text("changed\n")
    assert transfers.fetch_training_data(job) is True  # the data of a job is fetched once, for all attempts
    assert (folder / "data" / "train.csv").read_text() == "1,2\n"

    (folder / "results" / "model.txt").write_text("m")
    assert transfers.push_results(job, runtime.of(job)) is None  # nothing failed
    assert (datastores.local_root(settings.DATA_DIR, alice.tenant.slug) / "trained" / job.id / "results" /
            "model.txt").exists()


@pytest.mark.django_db(transaction=True)
def test_a_tenants_second_download_waits_its_turn_without_holding_a_worker(settings):
    from jobs import outbox
    from jobs.models import Status
    from tenants import throttling
    alice = member()
    job, _ = pending_local_job(alice, settings.DATA_DIR, {"train.csv": b"1,2\n"})
    with throttling.slot(transfers._downloading(), alice.tenant_id) as held:  # another job's download
        assert held
        with pytest.raises(outbox.NotYet, match="waits its turn"):
            transfers.fetch_training_data(job)
        job.refresh_from_db()
        assert job.status == Status.PENDING
        theirs, _ = pending_local_job(member("team-b", "bob"), settings.DATA_DIR, {})
        assert transfers.fetch_training_data(theirs) is True  # another tenant goes on
    assert transfers.fetch_training_data(job) is True


@pytest.mark.django_db(transaction=True)
def test_a_download_past_the_jobs_data_cap_fails_it_and_leaves_no_partial_file(settings):
    from jobs.models import Status
    job, _ = pending_local_job(member(), settings.DATA_DIR, {"a.bin": b"x" * (3 * 2**20)},
                               LOCAL_JOB.replace("framework:", "disk: {data: 1MiB}\nframework:"))
    assert transfers.fetch_training_data(job) is False
    job.refresh_from_db()
    assert job.status == Status.FAILED
    assert "holds 3.0 MiB, more than the job's data cap (disk.data) of 1.0 MiB" in job.status_reason
    assert not list((storage.job_dir(job.tenant.slug, job.id) / "data").glob("*"))


TWO_LOCAL_STORES_JOB = LOCAL_JOB + """
  - id: gone
    type: local
    training_data: {container: missing}
"""


@pytest.mark.django_db(transaction=True)
def test_a_download_failing_part_way_leaves_nothing_of_it_in_data_dir(settings):
    from jobs.models import Status
    job, _ = pending_local_job(member(), settings.DATA_DIR, {"train.csv": b"1,2\n"}, TWO_LOCAL_STORES_JOB)
    assert transfers.fetch_training_data(job) is False  # 'shelf' is fetched, then 'gone' has no folder
    job.refresh_from_db()
    assert job.status == Status.FAILED and "data store 'gone'" in job.status_reason
    assert not list((storage.job_dir(job.tenant.slug, job.id) / "data").iterdir())


@pytest.mark.django_db(transaction=True)
def test_a_download_starts_over_from_an_empty_data_dir(settings):
    """What a worker killed mid-download left (files of another listing, a temporary file) is not
    kept beside the new download, whose allowance knows nothing of it."""
    job, _ = pending_local_job(member(), settings.DATA_DIR, {"train.csv": b"1,2\n"})
    data = storage.job_dir(job.tenant.slug, job.id) / "data"
    (data / "old" / "deep").mkdir(parents=True)
    (data / "old" / "deep" / "part.bin").write_bytes(b"x" * 1000)
    (data / ".tmp-train.csv").write_bytes(b"half")
    assert transfers.fetch_training_data(job) is True
    assert sorted(path.name for path in data.iterdir()) == [datastores.FETCHED_MARK, "train.csv"]
    assert not (data.parent / ".data-stale").exists()


def test_an_allowance_counts_what_is_written_and_the_time_it_takes(tmp_path):
    allowance = datastores.Allowance(10, 3600, cap="data cap")
    allowance.listed(10, "lake")  # what a listing says is only a first check
    with pytest.raises(DataStoreError, match="went past the job's data cap"):
        datastores._write([b"12345", b"678901"], tmp_path / "f", allowance, label="lake")
    assert not list(tmp_path.iterdir())  # neither the file nor its temporary one
    late = datastores.Allowance(10, 0, cap="data cap")
    with pytest.raises(DataStoreError, match="took longer than 0s"):
        late.take(1, "lake")


def test_an_object_named_as_the_platforms_mark_of_a_complete_download_is_refused(tmp_path):
    (tmp_path / "store" / "digits").mkdir(parents=True)
    (tmp_path / "store" / "digits" / datastores.FETCHED_MARK).write_text("")
    source = datastores.Location(datastores.LocalStore(tmp_path / "store"), "digits", "data store 'shelf'")
    with pytest.raises(DataStoreError, match="a name the platform keeps for itself"):
        datastores.fetch(source, tmp_path / "data")


@pytest.mark.django_db(transaction=True)
def test_a_failed_download_fails_the_job_with_the_reason():
    from jobs.models import Status
    from jobs.states import transition
    alice = member()
    job = Job.objects.get(pk=submit(alice, LOCAL_JOB).json()["id"])  # its folder was never created
    transition(job.id, Status.PENDING, actor="test")
    job.refresh_from_db()
    assert transfers.fetch_training_data(job) is False
    job.refresh_from_db()
    assert job.status == Status.FAILED
    assert job.status_reason.startswith("downloading training data failed: data store 'shelf': folder ")


BAD_ENDPOINT_JOB = """
name: bad-endpoint
framework: {name: custom, command: sh run.sh}
data_stores:
  - id: lake
    type: s3_datastore
    training_data: {container: data-bucket/inputs}
    connection: {auth_url: 'http://bad_host.example.com'}
"""


@pytest.mark.django_db(transaction=True)
def test_a_download_failing_on_what_boto_refuses_fails_the_job_instead_of_retrying_for_ever():
    from jobs.models import Status
    from jobs.states import transition
    alice = member()
    job = Job.objects.get(pk=submit(alice, BAD_ENDPOINT_JOB).json()["id"])
    transition(job.id, Status.PENDING, actor="test")
    job.refresh_from_db()
    assert transfers.fetch_training_data(job) is False
    job.refresh_from_db()
    assert job.status == Status.FAILED
    assert job.status_reason.startswith("downloading training data failed: ValueError: Invalid endpoint")


def test_a_data_stores_error_text_is_cut_short():
    from botocore.exceptions import ClientError
    error = ClientError({"Error": {"Code": "SlowDown" * 100, "Message": "x" * 5_000_000}}, "GetObject")
    explained = datastores._explain_client_error(error)
    assert len(explained) <= 60 + 2 + datastores.MAX_SERVER_TEXT
    assert len(datastores.failure_text(DataStoreError("y" * 5_000_000))) == datastores.MAX_REASON


@pytest.mark.django_db(transaction=True)
def test_credentials_are_deleted_when_the_job_ends():
    from jobs.models import Status
    from jobs.states import transition
    alice = member()
    job = Job.objects.get(pk=submit(alice, MANIFEST).json()["id"])
    sealed = storage.job_dir(job.tenant.slug, job.id) / datastores.SEALED_FILE
    assert sealed.exists()
    transition(job.id, Status.PENDING, actor="test")
    assert sealed.exists()  # not final: a restart or resume needs them
    transition(job.id, Status.TERMINATED, actor="test")
    assert not sealed.exists()


# --- local stores are per tenant -------------------------------------------------------------------
LOCAL_SPEC = {"id": "shelf", "type": "local", "training_data": {"container": "digits"},
              "training_results": {"container": "trained"}}


def local_location(tmp_path, tenant, container="digits", section="training_data"):
    spec = dict(LOCAL_SPEC, **{section: {"container": container}})
    return datastores.location(spec, section, {}, data_root=tmp_path, tenant=tenant, egress=None)


def test_the_same_local_container_names_each_tenants_own_folder(tmp_path):
    for tenant in ("team-a", "team-b"):
        (datastores.local_root(tmp_path, tenant) / "digits").mkdir(parents=True)
        (datastores.local_root(tmp_path, tenant) / "digits" / "owner.txt").write_text(tenant)
    datastores.fetch(local_location(tmp_path, "team-b"), tmp_path / "data")
    assert (tmp_path / "data" / "owner.txt").read_text() == "team-b"


@pytest.mark.parametrize("container", ["../team-a/digits", "/etc", "digits/../../team-a/digits"])
def test_a_local_container_outside_the_tenants_folder_is_refused_naming_the_field(tmp_path, container):
    (datastores.local_root(tmp_path, "team-a") / "digits").mkdir(parents=True)
    datastores.local_root(tmp_path, "team-b").mkdir(parents=True)
    with pytest.raises(DataStoreError, match=r"training_results\.container .* leads outside the tenant's local"):
        local_location(tmp_path, "team-b", container, section="training_results")


def test_a_symlink_out_of_the_tenants_folder_is_refused_for_reading_and_writing(tmp_path):
    theirs = datastores.local_root(tmp_path, "team-a") / "digits"
    theirs.mkdir(parents=True)
    (theirs / "secret.txt").write_text("team-a only")
    mine = datastores.local_root(tmp_path, "team-b")
    mine.mkdir(parents=True)
    (mine / "digits").symlink_to(theirs)
    with pytest.raises(DataStoreError, match=r"training_data\.container 'digits' leads outside"):
        local_location(tmp_path, "team-b")
    (mine / "trained").mkdir()
    (mine / "trained" / "job-1").symlink_to(theirs)  # a link deeper down, met only while writing
    store = local_location(tmp_path, "team-b", "trained", section="training_results")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "x.txt").write_text("planted")
    with pytest.raises(DataStoreError, match="leads outside"):
        datastores.push({"results": tmp_path / "results"}, Location(store.store, "trained/job-1", store.label))
    assert not (theirs / "results").exists()


@pytest.mark.parametrize("doing", ["read", "write"])
def test_a_folder_swapped_for_a_link_after_the_check_leads_nowhere(tmp_path, monkeypatch, doing):
    """Someone who can write in team-b's folder swaps `digits` for a link to team-a's between the
    check that the key stays inside and the open: the open does not follow it."""
    import io
    theirs = datastores.local_root(tmp_path, "team-a") / "digits"
    theirs.mkdir(parents=True)
    (theirs / "secret.txt").write_text("team-a only")
    mine = datastores.local_root(tmp_path, "team-b")
    (mine / "digits").mkdir(parents=True)
    (mine / "digits" / "secret.txt").write_text("team-b's")
    store = datastores.LocalStore(mine, name="shelf", confined=True)
    checked = store.path_of

    def check_then_swap(key, **named):
        path = checked(key, **named)
        (mine / "digits" / "secret.txt").unlink()
        (mine / "digits").rmdir()
        (mine / "digits").symlink_to(theirs)
        return path

    monkeypatch.setattr(store, "path_of", check_then_swap)
    with pytest.raises(DataStoreError, match="'digits' is a symbolic link or not a folder"):
        if doing == "read":
            store.get("digits/secret.txt", tmp_path / "got.txt")
        else:
            store.put(io.BytesIO(b"planted"), "digits/secret.txt")
    assert not (tmp_path / "got.txt").exists()
    assert [p.name for p in theirs.iterdir()] == ["secret.txt"] and (theirs / "secret.txt").read_text() == "team-a only"


def test_a_confined_listing_shows_nothing_of_where_a_link_points(tmp_path, monkeypatch):
    """A listing walks folders by descriptor too: a folder swapped for a link to team-a's after the
    check, or a link placed deeper down, shows neither names nor sizes from there."""
    theirs = datastores.local_root(tmp_path, "team-a") / "digits"
    theirs.mkdir(parents=True)
    (theirs / "secret-plans.txt").write_text("team-a only")
    mine = datastores.local_root(tmp_path, "team-b")
    (mine / "digits" / "train").mkdir(parents=True)
    (mine / "digits" / "train" / "a.bin").write_bytes(b"12345")
    (mine / "digits" / "labels.csv").write_bytes(b"1,2")
    (mine / "digits" / "train" / "more").symlink_to(theirs)
    store = datastores.LocalStore(mine, name="shelf", confined=True)
    assert [(o.key, o.size) for o in store.list("digits/")] == [("digits/labels.csv", 3), ("digits/train/a.bin", 5)]
    checked = store.path_of

    def check_then_swap(key, **named):
        path = checked(key, **named)
        (mine / "digits").rename(mine / "digits-old")
        (mine / "digits").symlink_to(theirs)
        return path

    monkeypatch.setattr(store, "path_of", check_then_swap)
    assert list(store.list("digits/")) == []
    monkeypatch.undo()
    with pytest.raises(DataStoreError, match="is not a folder inside the store"):
        list(store.list("digits-old/../digits-old/"))  # never walked through '..'


def test_a_link_inside_the_tenants_folder_is_refused_naming_the_field(tmp_path):
    mine = datastores.local_root(tmp_path, "team-b")
    (mine / "digits-v2").mkdir(parents=True)
    (mine / "digits").symlink_to(mine / "digits-v2")
    with pytest.raises(DataStoreError, match=r"training_data\.container 'digits' goes through a symbolic link"):
        local_location(tmp_path, "team-b")
    assert local_location(tmp_path, "team-b", "digits-v2").prefix == "digits-v2"


def test_a_confined_local_store_writes_and_reads_nested_keys(tmp_path):
    import io
    store = datastores.LocalStore(tmp_path / "team-b", name="shelf", confined=True)
    store.put(io.BytesIO(b"weights"), "trained/job-1/results/model.bin")
    store.put(io.BytesIO(b"newer"), "trained/job-1/results/model.bin")  # written again: replaced whole
    store.get("trained/job-1/results/model.bin", tmp_path / "out" / "model.bin")
    assert (tmp_path / "out" / "model.bin").read_bytes() == b"newer"
    assert [p.name for p in (tmp_path / "team-b" / "trained" / "job-1" / "results").iterdir()] == ["model.bin"]
    with pytest.raises(DataStoreError, match="'trained/job-1/nothing' does not exist"):
        store.get("trained/job-1/nothing", tmp_path / "out" / "nothing")


def test_files_nested_past_the_depth_a_learner_may_use_are_passed_over_without_recursing(tmp_path):
    import os
    from pathlib import Path

    from learner_agent import diskwatch
    from learner_agent import trees
    (tmp_path / "top.txt").write_text("t")
    deep = str(tmp_path)
    try:
        for _ in range(1500):  # os.walk recursed once per level: a RecursionError past about a thousand
            deep = os.path.join(deep, "d")
            os.mkdir(deep)
        kept = Path(tmp_path, *["d"] * diskwatch.MAX_DEPTH, "kept.txt")
        kept.write_text("k")
        Path(tmp_path, *["d"] * (diskwatch.MAX_DEPTH + 1), "past.txt").write_text("p")
        found = [path.relative_to(tmp_path) for path in datastores.regular_files(tmp_path)]
        assert found == [Path("top.txt"), kept.relative_to(tmp_path)]
    finally:
        trees.remove(tmp_path / "d")  # pytest's own clean-up of old temporary folders uses rmtree
