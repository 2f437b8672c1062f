"""A simulator for elastic jobs: Poisson arrivals of jobs drawn from measured scaling curves, run
through the real `gpu_scheduler.elastic.optimize` on every arrival and completion.

- A job is a target amount of progress: `work` samples at its own batch. With the statistical-
  efficiency model on, a sample at global batch M is worth (B + M0)/(B + M) of one at M0 (B: the
  job's gradient noise scale), so a bigger batch needs more samples; off, progress is samples (a
  fixed number of epochs), which flatters big batches.
- Each resize of a running job (a new learner count or batch) stops its progress for `restart_s`;
  the first start is free under every policy (chosen: the pod start is the same for all).
- The optimizer does not see a job's true curve: it sees a model fitted (throughput.fit) from the
  step times the job has reported at the shapes it has run (5% noise), from a generic prior, and,
  under `trainyard`, the noise scale the job reports (20% noise). The simulator uses the truth.
- Admission: a job arriving while `admission_limit` jobs are in the system (running or waiting) is
  dropped, as the paper's system drops jobs it cannot serve (the paper's rule is not at hand).
"""
import math
import random
from dataclasses import dataclass, field, replace

from gpu_scheduler.elastic import ElasticCluster, ElasticJob, optimize
from gpu_scheduler.throughput import GENERIC_PRIOR, FFDL_RESNET, calibrated, efficiency, fit


@dataclass(frozen=True)
class Profile:
    """A model's scaling curve and gradient noise scale, and where they come from."""
    name: str
    model: object  # ThroughputModel (the truth)
    noise_scale: float  # B, in samples
    base_batch: int  # the job's own global batch
    max_gpus: int
    share: float  # of the jobs
    source: str


PROFILES = (
    Profile("resnet50-imagenet", FFDL_RESNET, 4000.0, 256, 32, 0.4,
            "FfDL: 313/539/929 img/s on 1/2/4 GPUs, 1,040 vs 1,752 for one vs two 4-GPU learners; "
            "B ~ 10^3-10^4 for ImageNet (McCandlish et al. 2018, fig. 4)"),
    Profile("resnet18-cifar10", calibrated(per_gpu_batch=128, one_gpu_rate=2500.0, within_2=0.3, within_4=0.6,
                                           across_8=1.4), 600.0, 128, 8, 0.3,
            "chosen: a fast small model, communication-bound; B ~ 10^2-10^3 for CIFAR-10 (McCandlish, fig. 4)"),
    Profile("bert-finetune", calibrated(per_gpu_batch=8, one_gpu_rate=40.0, within_2=0.2, within_4=0.45,
                                        across_8=1.0), 400.0, 32, 16, 0.2,
            "chosen: a large model with large gradients; small noise scale of fine-tuning (Pollux, table 1 "
            "lists BERT fine-tuning among its workloads; the number is ours)"),
    Profile("deepspeech2", calibrated(per_gpu_batch=20, one_gpu_rate=60.0, within_2=0.15, within_4=0.35,
                                      across_8=0.8), 2000.0, 20, 16, 0.1,
            "chosen: an RNN with moderate communication; B chosen"),
)


@dataclass(frozen=True)
class ElasticTraceJob:
    job_id: str
    tenant: str
    arrival_s: float
    profile: Profile
    requested_learners: int
    gpus_per_learner: int
    max_learners: int
    work: float  # samples at the job's own batch
    duration_s: float  # run time at its requested shape and batch (what `load` is computed from)


def elastic_trace(jobs, *, seed, cluster_gpus, load, tenants=("a", "b", "c", "d"), median_s=2700.0, sigma=1.0):
    """`jobs` jobs arriving as a Poisson process offering `load` x the cluster's GPUs at their
    requested shapes; learners 1/2/4/8 at 50/25/15/10%, 25% of jobs with 2 GPUs per learner,
    log-normal run times (median 45 min, 5 min to 12 h), profiles by their shares."""
    rng = random.Random(seed)
    drafts = []
    for index in range(jobs):
        profile = rng.choices(PROFILES, weights=[p.share for p in PROFILES])[0]
        per = 2 if rng.random() < 0.25 else 1
        learners = rng.choices([1, 2, 4, 8], weights=[50, 25, 15, 10])[0]
        learners = max(1, min(learners, profile.max_gpus // per))
        duration = min(12 * 3600.0, max(300.0, rng.lognormvariate(math.log(median_s), sigma)))
        drafts.append((index, profile, per, learners, duration, rng.choices(tenants, weights=[4, 3, 2, 1])[0]))
    mean_gpu_s = sum(per * learners * duration for _, _, per, learners, duration, _ in drafts) / jobs
    rate = load * cluster_gpus / mean_gpu_s
    clock, trace = 0.0, []
    for index, profile, per, learners, duration, tenant in drafts:
        clock += rng.expovariate(rate)
        gpus = per * learners
        speed = profile.model.throughput(gpus, 1 if gpus <= 4 else math.ceil(gpus / 4), profile.base_batch)
        trace.append(ElasticTraceJob(f"job-{index:05d}", tenant, clock, profile, learners, per,
                                     max(learners, profile.max_gpus // per), speed * duration, duration))
    return trace


@dataclass
class ElasticRecord:
    spec: ElasticTraceJob
    remaining: float
    job: ElasticJob  # what the optimizer sees (current shape, fitted model)
    ready_at: float = 0.0  # restarting until then
    finished_s: float | None = None
    dropped: bool = False
    restarts: int = 0
    observations: list = field(default_factory=list)
    observed: set = field(default_factory=set)

    @property
    def jct_s(self):
        return self.finished_s - self.spec.arrival_s


@dataclass
class ElasticResult:
    policy: str
    records: list
    horizon_s: float  # last arrival: jobs completed by then are "completed" in the paper's sense

    def completed_by_horizon(self):
        return sum(1 for r in self.records if r.finished_s is not None and r.finished_s <= self.horizon_s)

    def dropped(self):
        return sum(r.dropped for r in self.records)

    def mean_jct_s(self):
        done = [r.jct_s for r in self.records if r.finished_s is not None]
        return sum(done) / len(done) if done else math.nan

    def restarts_per_job(self):
        admitted = [r for r in self.records if not r.dropped]
        return sum(r.restarts for r in admitted) / max(1, len(admitted))


def run_elastic(trace, nodes, *, policy, restart_s=60.0, efficiency_model=True, admission_limit=64, quotas=None,
                seed=0):
    """Replays `trace` on `nodes` ({name: GPUs}); returns an ElasticResult."""
    rng = random.Random(seed)
    cluster = ElasticCluster(dict(nodes), dict(quotas or {}))
    pending = sorted(trace, key=lambda j: j.arrival_s)
    records, active = [], []
    now, next_arrival = 0.0, 0
    while next_arrival < len(pending) or active:
        arrival_at = pending[next_arrival].arrival_s if next_arrival < len(pending) else math.inf
        finish_at, finishing = next_completion(active, now, efficiency_model)
        step_to = min(arrival_at, finish_at)
        advance(active, now, step_to, efficiency_model)
        now = step_to
        if finishing is not None and finish_at <= arrival_at:
            finishing.finished_s, finishing.remaining = now, 0.0
            active.remove(finishing)
        else:
            spec = pending[next_arrival]
            next_arrival += 1
            record = new_record(spec, restart_s, policy, rng, efficiency_model)
            records.append(record)
            if len(active) >= admission_limit:
                record.dropped = True
                continue
            active.append(record)
        apply(optimize([r.job for r in active], cluster, policy, now=now), active, now, rng)
    horizon = pending[-1].arrival_s if pending else 0.0
    return ElasticResult(policy.name, records, horizon)


def new_record(spec, restart_s, policy, rng, efficiency_model):
    reported = spec.profile.noise_scale * rng.lognormvariate(0.0, 0.2) if policy.name == "trainyard" else None
    if not efficiency_model:  # the efficiency model off everywhere: jobs are fixed epochs and nobody reports B
        reported = None
    job = ElasticJob(spec.job_id, spec.tenant, 1, spec.max_learners, spec.gpus_per_learner,
                     spec.profile.base_batch, batch_min=max(8, spec.profile.base_batch // 8),
                     batch_max=spec.profile.base_batch * 32, requested_learners=spec.requested_learners,
                     max_local_batch=256, model=GENERIC_PRIOR, noise_scale=reported, restart_s=restart_s,
                     order=int(spec.job_id.split("-")[1]))
    return ElasticRecord(spec, spec.work, job)


def true_rate(record, efficiency_model):
    """Progress per second (samples at the job's own batch) of the job's current shape, by the truth."""
    job = record.job
    if not job.running:
        return 0.0
    gpus = job.learners * job.gpus_per_learner
    nodes = len(set(job.placement))
    speed = record.spec.profile.model.throughput(gpus, nodes, job.batch)
    if efficiency_model:
        speed *= efficiency(job.batch, job.base_batch, record.spec.profile.noise_scale)
    return speed


def next_completion(active, now, efficiency_model):
    best, which = math.inf, None
    for record in active:
        speed = true_rate(record, efficiency_model)
        if speed > 0:
            at = max(now, record.ready_at) + record.remaining / speed
            if at < best:
                best, which = at, record
    return best, which


def advance(active, start, end, efficiency_model):
    for record in active:
        working = max(0.0, end - max(start, record.ready_at))
        if working > 0:
            record.remaining = max(0.0, record.remaining - working * true_rate(record, efficiency_model))


def apply(targets, active, now, rng):
    """Carry a plan out: a running job whose shape changes restarts; every new shape is observed."""
    for record in active:
        target, job = targets[record.job.job_id], record.job
        if (target.learners, target.batch, target.placement) == (job.learners, job.batch, job.placement):
            continue
        reshaped = (target.learners, target.batch) != (job.learners, job.batch)
        if job.running and reshaped:
            record.restarts += 1
            record.ready_at = now + job.restart_s
        started = job.started_s if job.started_s is not None else (now if target.learners else None)
        record.job = replace(job, learners=target.learners, batch=target.batch, placement=target.placement,
                             started_s=started)
        if target.learners:
            observe(record, rng)


def observe(record, rng):
    """The job reports its step time at its new shape (5% noise); the optimizer's model is refitted."""
    job = record.job
    gpus = job.learners * job.gpus_per_learner
    nodes = len(set(job.placement))
    local = job.batch / gpus
    if (gpus, nodes, local) in record.observed:
        return
    record.observed.add((gpus, nodes, local))
    step = record.spec.profile.model.step_time(gpus, nodes, local) * rng.lognormvariate(0.0, 0.05)
    record.observations.append((gpus, nodes, local, step))
    record.job = replace(job, model=fit(record.observations, GENERIC_PRIOR))
