"""Browser pages: jobs, submit, one job, the tenant's usage, the cluster.

Pages render what the server knows at once (so a page is useful before any script runs); the
scripts in static/js/ then keep it live over the websockets and the REST API.
"""
import contextlib
import functools
import time
from datetime import timedelta
from pathlib import Path

from django.contrib.auth.decorators import login_required
from django.db.models import Count, OuterRef, Subquery
from django.db.models.functions import Coalesce
from django.core.files import File
from django.core.files.uploadedfile import SimpleUploadedFile
from django.http import Http404, HttpResponseBadRequest, StreamingHttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_http_methods

from jobs import compare, datastores, elastic_timeline, listing, runs, serving, submission, tenancy, usage
from jobs.models import ACTIVE, IdleGpuPolicy, Job, Status
from tenants import access, throttling
from tenants.models import Membership, Tenant
from trainyard.manifest import FRAMEWORKS
from trainyard.packing import code_upload

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
LOG_DOWNLOAD_BATCH = 5000


def tenant_page(view):
    """Log in, resolve the tenant the request acts in, and pass its membership to the view. A user of
    no tenant sees why (a platform admin: every tenant, to open one); naming a tenant one may not see
    is refused."""
    @login_required
    @functools.wraps(view)
    def wrapper(request, *args, **kwargs):
        try:
            membership = access.request_membership(request)
        except access.NoTenant as exc:
            named = access.requested_tenant(request)
            if not named and access.is_platform_admin(request.user):
                return render(request, "platform_tenants.html", {"tenants": _tenants_overview()})
            return render(request, "no_tenant.html", {"reason": str(exc), "named": named},
                          status=403 if named else 200)
        return view(request, membership, *args, **kwargs)
    return wrapper


def _tenants_overview():
    """Every tenant with its members and its jobs waiting and running, for a platform admin. Each is
    counted on its own: counted through one join, every member was paired with every job."""
    return (Tenant.objects.order_by("slug")
            .annotate(member_count=_count_of(Membership.objects.all()),
                      queued=_count_of(Job.objects.filter(status=Status.QUEUED)),
                      running=_count_of(Job.objects.filter(status__in=ACTIVE))))


def _count_of(rows):
    """How many of `rows` (a model with a `tenant`) belong to the tenant in hand, as a subquery."""
    counted = rows.filter(tenant=OuterRef("pk")).order_by().values("tenant").annotate(n=Count("pk")).values("n")
    return Coalesce(Subquery(counted), 0)


def server_timing(view):
    """Say how long the view took in a Server-Timing header: browsers show it (devtools, the
    Navigation Timing API), which is how `python -m bench ui` reads the server's share of a page load."""
    @functools.wraps(view)
    def wrapper(request, *args, **kwargs):
        started = time.perf_counter()
        response = view(request, *args, **kwargs)
        if hasattr(response, "render") and not response.is_rendered:
            response.render()
        response["Server-Timing"] = f"view;dur={(time.perf_counter() - started) * 1000:.1f}"
        return response
    return wrapper


# --- jobs ----------------------------------------------------------------------------------------
@server_timing
@tenant_page
def job_list(request, membership):
    error = None
    try:
        query = listing.JobQuery.from_params(request.GET)
    except listing.ListingError as exc:
        query, error = listing.JobQuery(), str(exc)
    try:
        columns = runs.Columns.from_params(request.GET)
    except listing.ListingError as exc:
        columns, error = runs.Columns(), error or str(exc)
    jobs = tenancy.jobs_of(membership).select_related("owner").only(*listing.LIST_COLUMNS, *columns.list_fields)
    page = query.page(jobs)
    columns.fill(page.rows)
    params = request.GET.copy()
    for cursor in ("after", "before"):
        params.pop(cursor, None)
    context = {"membership": membership, "page": page, "query": query, "columns": columns, "error": error,
               "statuses": Status.values, "frameworks": FRAMEWORKS, "sorts": SORT_LABELS,
               "members": Membership.objects.filter(tenant=membership.tenant).select_related("user")
               .order_by("user__username").values_list("user__username", flat=True),
               "base_query": params.urlencode(), "count": query.filter(jobs).count(), "max_compare": compare.MAX_JOBS,
               "has_any": bool(page.rows) or query.is_filtered or tenancy.jobs_of(membership).exists()}
    # htmx asks for the results only when a filter, sort or page link changes.
    template = "jobs/_results.html" if request.headers.get("HX-Request") else "jobs/list.html"
    return render(request, template, context, status=400 if error else 200)


SORT_LABELS = {"-created": "Newest first", "created": "Oldest first", "name": "Name A–Z", "-name": "Name Z–A",
               "status": "Status A–Z", "-status": "Status Z–A"}


@tenant_page
def job_page(request, membership, job_id):
    job = tenancy.job_or_404(membership, job_id)
    idle_policy = IdleGpuPolicy.objects.filter(tenant_id=job.tenant_id).first() if job.gpus_idle else None
    return render(request, "jobs/detail.html", {"job": job, "membership": membership, "run": runs.facts(job),
                                                "elastic": elastic_timeline.summary(job), "idle_policy": idle_policy,
                                                "can_delete": tenancy.can_manage(membership, job)})


@tenant_page
def compare_page(request, membership):
    """Several jobs side by side (/jobs/compare/?ids=a,b,c): the table of what differs is rendered here,
    the charts are drawn by static/js/compare.js from the same comparison over the REST API."""
    try:
        ids = compare.parse_ids(request.GET.getlist("ids"))
        comparison = compare.compare(membership, ids, charted=False)  # compare.js reads the lines from the API
    except compare.CompareError as exc:
        return render(request, "jobs/compare.html", {"membership": membership, "error": str(exc)}, status=400)
    except throttling.Busy as exc:
        response = render(request, "jobs/compare.html", {"membership": membership, "error": str(exc)}, status=429)
        response["Retry-After"] = str(exc.retry_after_s)
        return response
    finals = [{"name": m["name"], "values": ["—" if v is None else f"{v:.6g}" for v in m["final"]]}
              for m in comparison.metrics]
    return render(request, "jobs/compare.html", {"membership": membership, "comparison": comparison,
                                                 "finals": finals, "ids": ",".join(ids),
                                                 "max_metrics": compare.MAX_METRICS})


@tenant_page
def job_log_download(request, membership, job_id):
    """The whole log as text, streamed a batch at a time (each read once the one before is sent), so a
    million lines never sit in memory at once."""
    job = tenancy.job_or_404(membership, job_id)
    learners = job.learners > 1

    def batches():
        since = 0
        while True:
            batch = list(job.log_lines.filter(seq__gt=since).order_by("seq")
                         .values_list("seq", "learner", "stream", "time", "line")[:LOG_DOWNLOAD_BATCH])
            if not batch:
                return
            text = []
            for _, learner, stream, stamp, line in batch:
                prefix = f"[learner {learner}] " if learners else ""
                marker = "E " if stream == "stderr" else ""
                text.append(f"{stamp.isoformat(timespec='milliseconds')} {marker}{prefix}{line}\n")
            yield "".join(text)
            since = batch[-1][0]

    response = StreamingHttpResponse(serving.SentAsRead(batches()), content_type="text/plain; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{job.id}.log"'
    return response


# --- submit --------------------------------------------------------------------------------------
def example_names():
    return sorted(p.parent.name for p in EXAMPLES.glob("*/manifest.yml"))


def _example_folder(name):
    if name not in example_names():
        raise Http404(f"No example {name!r}.")
    return EXAMPLES / name


@tenant_page
@require_http_methods(["GET", "POST"])
def submit_page(request, membership):
    """The submit form; `?clone=ID` fills it with one of the tenant's jobs' manifest and offers that job's
    stored code (another tenant's job, or one the member may not see, is a 404)."""
    source = request.POST if request.method == "POST" else request.GET
    clone = tenancy.job_or_404(membership, source["clone"]) if source.get("clone") else None
    context = {"membership": membership, "examples": example_names(), "error": None, "field": None,
               "manifest_text": "", "example": request.GET.get("example", ""), **_clone_context(clone)}
    if request.method == "POST":
        context.update(manifest_text=request.POST.get("manifest", ""), example=request.POST.get("example", ""),
                       reuse_code=bool(request.POST.get("reuse_code")))
        try:
            with uploaded_code(request, context["example"], clone if context["reuse_code"] else None) as code_file:
                job = submission.submit(membership, manifest_bytes=context["manifest_text"].encode(),
                                        code_file=code_file)
        except submission.SubmitError as exc:
            context.update(error=exc.detail, field=exc.field)
            response = render(request, "jobs/submit.html", context, status=exc.status)
            for header, value in exc.headers().items():
                response[header] = value
            return response
        return redirect("job-page", job_id=job.id)
    if clone is not None:
        context["manifest_text"] = datastores.redact_yaml(clone.manifest_yaml)
    elif context["example"] in context["examples"]:
        context["manifest_text"] = (_example_folder(context["example"]) / "manifest.yml").read_text()
    return render(request, "jobs/submit.html", context)


def _clone_context(clone):
    """What the submit form shows of the job it clones: the job, whether its code is still stored (to be
    reused, ticked at first), and whether its manifest's credentials were redacted (to be given again)."""
    if clone is None:
        return {"clone": None, "clone_code": None, "reuse_code": False, "redacted": False}
    archive = submission.code_archive(clone)
    return {"clone": clone, "clone_code": archive, "reuse_code": archive is not None,
            "redacted": datastores.REDACTED in datastores.redact_yaml(clone.manifest_yaml)}


@contextlib.contextmanager
def uploaded_code(request, example, clone):
    """The uploaded archive; else the chosen example's folder packed the way the CLI packs it; else the
    stored code of the job being cloned (`clone`, when reusing it was asked for); else None."""
    if upload := request.FILES.get("code"):
        yield upload
    elif example:
        packed = code_upload(_example_folder(example))
        with packed.fileobj:
            yield SimpleUploadedFile(packed.filename, packed.fileobj.read(), content_type=packed.content_type)
    elif clone is not None:
        archive = submission.code_archive(clone)
        if archive is None:
            raise submission.SubmitError(f"{clone.id}'s code is no longer stored; choose a code archive",
                                         field="code")
        with archive.open("rb") as stored:
            yield File(stored, name=archive.name)
    else:
        yield None


@login_required
def example_manifest(request, name):
    """An example's manifest text, for the submit page's example picker."""
    if name not in example_names():
        return HttpResponseBadRequest(f"No example {name!r}; choose one of {', '.join(example_names())}.",
                                      content_type="text/plain")
    return StreamingHttpResponse([(_example_folder(name) / "manifest.yml").read_text()],
                                 content_type="text/plain; charset=utf-8")


# --- tenant and cluster ------------------------------------------------------------------------------
@tenant_page
def tenant_usage(request, membership):
    """The quota bars (tenant.js, from the API) and, rendered here, allocated against used for a period."""
    context = {"membership": membership}
    try:
        start, end = usage.period_of(membership.tenant, request.GET)
    except usage.PeriodError as exc:
        context["usage_error"] = str(exc)
        start, end = usage.period_of(membership.tenant, {})
    status = 200
    try:
        context["usage"] = usage.report_for(membership, start=start, end=end)
    except throttling.Busy as exc:
        context["usage_error"], status = str(exc), 429
    context["idle_policy"] = IdleGpuPolicy.objects.filter(tenant=membership.tenant).first()
    context["usage_period"] = {"start": timezone.localtime(start).date().isoformat(),
                               "end": (timezone.localtime(end) - timedelta(microseconds=1)).date().isoformat()}
    response = render(request, "tenant.html", context, status=status)
    if status == 429:
        response["Retry-After"] = str(throttling.Busy.retry_after_s)
    return response


@tenant_page
def cluster_page(request, membership):
    return render(request, "cluster.html", {"membership": membership})
