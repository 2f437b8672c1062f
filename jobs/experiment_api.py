"""REST endpoints for experiments (SPEC §4): tenant-scoped like jobs, an experiment another tenant owns
is a 404. The trials themselves are jobs: their logs, metrics and actions are the jobs endpoints'."""
from contextlib import nullcontext
from datetime import datetime, timedelta

from django.db.models import Q
from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_field
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from jobs import deletion, experiments
from jobs.api import TenantScoped
from jobs.bounds import BoundedMultiPartParser, moment, whole_number
from jobs.models import Experiment, MetricPoint
from jobs.serializers import ErrorSerializer, SubmitRequestSerializer

MAX_POINTS = 10_000  # metric points in one answer of /metrics/ (after= pages on), as the jobs' own
# How far before an answer was read its `next_changed_after` lies: a change stamped before the read but
# committed after it (a scheduling pass's transaction) is then in the next answer too.
CHANGES_OVERLAP = timedelta(seconds=60)


# --- what answers look like --------------------------------------------------------------------------
class TrialSerializer(serializers.Serializer):
    number = serializers.IntegerField()
    job_id = serializers.CharField()
    job_status = serializers.CharField(source="job.status")
    state = serializers.CharField(help_text="running, paused (ASHA: at a rung), completed, stopped or failed")
    params = serializers.DictField(help_text="every hyperparameter's value, constants included")
    value = serializers.FloatField(allow_null=True, help_text="the searcher's metric: latest, or final once completed")
    step = serializers.IntegerField(allow_null=True)
    rungs = serializers.DictField(child=serializers.FloatField(), help_text="ASHA: {rung index: value there}")
    promoted = serializers.IntegerField(help_text="ASHA: the highest rung it was let go on from (-1: none)")


class HyperparameterSerializer(serializers.Serializer):
    name = serializers.CharField()
    type = serializers.CharField()
    minval = serializers.FloatField(allow_null=True)
    maxval = serializers.FloatField(allow_null=True)
    count = serializers.IntegerField(allow_null=True)
    vals = serializers.ListField(child=serializers.JSONField())


class ExperimentSerializer(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.username")
    tenant = serializers.CharField(source="tenant.slug")
    max_trials = serializers.SerializerMethodField()
    max_concurrent_trials = serializers.SerializerMethodField()

    class Meta:
        model = Experiment
        fields = ["id", "name", "description", "tenant", "owner", "state", "state_reason", "searcher", "metric",
                  "smaller_is_better", "private", "trials_started", "max_trials", "max_concurrent_trials",
                  "best_trial", "best_value", "created_at", "updated_at", "finished_at"]

    # A listed row has them annotated (experiments.listed), an experiment's own its whole spec.
    def get_max_trials(self, experiment) -> int:
        return getattr(experiment, "max_trials", None) or experiment.spec["searcher"]["max_trials"]

    def get_max_concurrent_trials(self, experiment) -> int:
        return (getattr(experiment, "max_concurrent_trials", None)
                or experiment.spec["searcher"]["max_concurrent_trials"])


class ExperimentDetailSerializer(ExperimentSerializer):
    hyperparameters = HyperparameterSerializer(source="spec.hyperparameters", many=True)
    searcher_settings = serializers.DictField(source="spec.searcher", help_text="the manifest's searcher block")
    rungs = serializers.SerializerMethodField()
    trials = serializers.SerializerMethodField()
    next_changed_after = serializers.SerializerMethodField()
    manifest_yaml = serializers.CharField(help_text="as submitted, data-store credentials redacted")

    class Meta(ExperimentSerializer.Meta):
        fields = ExperimentSerializer.Meta.fields + ["hyperparameters", "searcher_settings", "rungs", "trials",
                                                     "next_changed_after", "manifest_yaml"]

    def get_rungs(self, experiment) -> list[int]:
        """ASHA's milestones (steps of the metric); [] for other searchers."""
        return experiments.rungs_of(experiment)

    @extend_schema_field(TrialSerializer(many=True))
    def get_trials(self, experiment):
        """Every trial; with ?changed_after=, those that (or whose jobs) changed since then."""
        trials = experiments.trials_of(experiment)
        if (since := self.context.get("changed_after")) is not None:
            trials = trials.filter(Q(updated_at__gte=since) | Q(job__updated_at__gte=since))
        return TrialSerializer(trials, many=True).data

    def get_next_changed_after(self, experiment) -> datetime:
        """Pass as ?changed_after= to be sent only the trials changed since this answer."""
        return self.context.get("read_at", timezone.now()) - CHANGES_OVERLAP


class ExperimentListSerializer(serializers.Serializer):
    results = ExperimentSerializer(many=True)


class TrialPointSerializer(serializers.Serializer):
    trial = serializers.IntegerField()
    job_id = serializers.CharField()
    step = serializers.IntegerField(allow_null=True)
    value = serializers.FloatField()
    time = serializers.DateTimeField()


class TrialPointsSerializer(serializers.Serializer):
    results = TrialPointSerializer(many=True)
    next_after = serializers.IntegerField(help_text="pass as `after` for the points that arrive later")


# --- views ----------------------------------------------------------------------------------------
class Scoped(TenantScoped):
    def experiment(self):
        return experiments.experiment_or_404(self.membership(), self.kwargs["experiment_id"])


class ExperimentList(Scoped, APIView):
    parser_classes = [BoundedMultiPartParser]

    @extend_schema(operation_id="v1_experiments_list",
                   parameters=[OpenApiParameter("state", str, description="only experiments in this state")],
                   responses={200: ExperimentListSerializer})
    def get(self, request):
        rows = experiments.listed(experiments.experiments_of(self.membership()).select_related("owner", "tenant")
                                  .order_by("-created_at"))
        if state := request.query_params.get("state"):
            if state.upper() not in Experiment.State.values:
                return Response({"detail": f"state {state!r} is not one of {', '.join(Experiment.State.values)}",
                                 "field": "state"}, status=400)
            rows = rows.filter(state=state.upper())
        return Response({"results": ExperimentSerializer(rows[:1000], many=True).data})

    @extend_schema(request={"multipart/form-data": SubmitRequestSerializer}, responses={
        201: ExperimentDetailSerializer,
        400: OpenApiResponse(ErrorSerializer, description="the manifest or code archive broke a rule; `field` names it"),
        403: OpenApiResponse(ErrorSerializer, description="a viewer, or `priority: high` not allowed here"),
        413: OpenApiResponse(ErrorSerializer, description="the code archive is larger than the platform takes"),
        429: OpenApiResponse(ErrorSerializer, description="past the tenant's submissions per minute, or as many "
                                                           "experiments not finished as it may have")})
    def post(self, request):
        membership = self.membership()
        admitted = experiments.submission.admit(membership)  # before the upload is parsed
        manifest = request.FILES.get("manifest")
        if manifest is None:
            return Response({"detail": "a manifest file (YAML) is required", "field": "manifest"}, status=400)
        if manifest.size > 64 * 1024:
            return Response({"detail": "manifest is larger than 64 KiB", "field": "manifest"}, status=400)
        experiment = experiments.create(membership, manifest_bytes=manifest.read(), code_file=request.FILES.get("code"),
                                        private=str(request.data.get("private", "")).lower() in ("1", "true", "on"),
                                        admitted=admitted)
        return Response(ExperimentDetailSerializer(experiment).data, status=status.HTTP_201_CREATED)


class ExperimentDetail(Scoped, APIView):
    @extend_schema(parameters=[OpenApiParameter(
        "changed_after", str, description="an earlier answer's `next_changed_after`: `trials` then holds only "
                                          "the trials that changed since (the page's refreshes ask this way)")],
        responses={200: ExperimentDetailSerializer, 429: OpenApiResponse(ErrorSerializer, description=(
            f"every trial of an experiment past {experiments.FREE_READ_TRIALS} asked while the tenant's other such "
            "reads take every slot; Retry-After says when to ask again"))})
    def get(self, request, experiment_id):
        context = {"read_at": timezone.now(), "changed_after": moment(request.query_params, "changed_after")}
        experiment = self.experiment()
        # The page's refreshes ask for the changes only: not every trial.
        reading = nullcontext() if context["changed_after"] is not None else experiments.reading_every_trial(experiment)
        with reading:
            return Response(ExperimentDetailSerializer(experiment, context=context).data)

    @extend_schema(request=None, responses={
        202: OpenApiResponse(ExperimentDetailSerializer, description=(
            "deleted with its trials' jobs: gone from every list, 404 from now on, its storage freed")),
        403: OpenApiResponse(ErrorSerializer, description="not the owner nor a tenant admin"),
        409: OpenApiResponse(ErrorSerializer, description="not finished (kill it first); `detail` says why")})
    def delete(self, request, experiment_id):
        experiment = self.experiment()
        if not experiments.can_control(self.membership(), experiment):
            return Response({"detail": "only the experiment's owner and tenant admins can delete it"}, status=403)
        experiment = deletion.delete_experiment(experiment, actor=request.user.username)
        return Response(ExperimentDetailSerializer(experiment).data, status=status.HTTP_202_ACCEPTED)


class ExperimentMetrics(Scoped, APIView):
    """The searcher's metric as every trial reported it, in the order the points arrived."""

    @extend_schema(parameters=[OpenApiParameter("after", int, description="points after this one (`next_after`)")],
                   responses={200: TrialPointsSerializer})
    def get(self, request, experiment_id):
        experiment = self.experiment()
        after = whole_number(request.query_params, "after", default=0, minimum=0, maximum=2**53)
        numbers = dict(experiment.trials.values_list("job_id", "number"))
        points = list(MetricPoint.objects.filter(job_id__in=list(numbers), name=experiment.metric, id__gt=after)
                      .order_by("id").values_list("id", "job_id", "step", "value", "time")[:MAX_POINTS])
        return Response({"results": [{"trial": numbers[job_id], "job_id": job_id, "step": step, "value": value,
                                      "time": when} for _, job_id, step, value, when in points],
                         "next_after": points[-1][0] if points else after})


class ExperimentAction(Scoped, APIView):
    """POST pause/ · resume/ · kill/: 202 with the experiment, or 409 saying why not now."""

    action = None  # set by as_view(action=...)
    ACTIONS = {"pause": experiments.pause, "resume": experiments.resume, "kill": experiments.kill}

    @extend_schema(request=None, responses={
        202: ExperimentDetailSerializer,
        403: OpenApiResponse(ErrorSerializer, description="not the owner nor a tenant admin"),
        409: OpenApiResponse(ErrorSerializer, description="not in a state that allows it; `detail` says why")})
    def post(self, request, experiment_id):
        experiment = self.experiment()
        if not experiments.can_control(self.membership(), experiment):
            return Response({"detail": f"only the experiment's owner and tenant admins can {self.action} it"},
                            status=403)
        experiment = self.ACTIONS[self.action](experiment, actor=request.user.username)
        return Response(ExperimentDetailSerializer(experiment).data, status=status.HTTP_202_ACCEPTED)

