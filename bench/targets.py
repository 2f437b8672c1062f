"""Each benchmark's headline figures (the keys SPEC §7 names, and a few more) with what they mean
and, where one is set, their target: the benchmarks' own tables show a target from here, and the
manual's benchmarks page (bench.docs) states each figure against it."""
import operator
from dataclasses import dataclass

COMPARE = {"≤": operator.le, "≥": operator.ge, "=": operator.eq}
FRAMEWORKS = ("pytorch", "keras", "tensorflow", "jax", "sklearn")
ELASTIC_LOADS = ("0.5", "1.0", "1.5", "2.0")


@dataclass(frozen=True)
class Figure:
    key: str
    meaning: str
    target: str = ""  # "≤ 1.10", "≥ 0.9", "= 0"; empty when the figure is reported, not held to a bound

    def met(self, value):
        """True/False against the target; None without a target or a number to compare."""
        if not self.target or not isinstance(value, (int, float)) or isinstance(value, bool):
            return None
        op, bound = self.target.split()
        return COMPARE[op](value, float(bound.replace(",", "")))


@dataclass(frozen=True)
class Bench:
    name: str  # its results file: bench/results/NAME.json
    method: str
    figures: tuple


BENCHES = (
    Bench("overhead", "The PyTorch example through the platform, each run between two bare runs of it at "
          "the same CPUs; the ratio is the median of each platform run over the bare runs around it.", (
              Figure("overhead_ratio", "wall time through Trainyard ÷ bare", "≤ 1.02"),
              Figure("submit_to_processing_p50_s", "submit → PROCESSING, median (s)", "≤ 1"),
              Figure("submit_to_processing_p95_s", "submit → PROCESSING, p95 (s)"),
              Figure("agent_rss_mb", "the learner agent's own peak RSS (MB)"),
              Figure("platform_idle_rss_mb", "web + worker + beat + Redis, idle (MB)"))),
    Bench("frameworks", "Every framework's example through the platform against the same command run "
          "bare, and 2-learner DDP against one learner.", (
              *(Figure(f"overhead_ratio_{name}", f"{name}: through Trainyard ÷ bare", "≤ 1.10")
                for name in FRAMEWORKS),
              Figure("ddp_2_learner_speedup", "2-learner DDP ÷ 1 learner, throughput"))),
    Bench("scheduler", "The scheduling policies in the simulator on synthetic traces against FfDL's "
          "placement (fifo_spread) and a Kueue-like policy, and one cycle over 10,000 queued jobs on 1,000 "
          "nodes.", (
              Figure("jct_ratio_vs_fifo_spread", "mean JCT ÷ FfDL's placement's", "≤ 0.6"),
              Figure("jct_ratio_vs_kueue_like", "mean JCT ÷ the Kueue-like policy's", "≤ 1.0"),
              Figure("partial_gangs", "gangs started with part of their learners", "= 0"),
              Figure("utilization_while_waiting", "GPU utilisation while jobs wait", "≥ 0.9"),
              Figure("jain_fairness", "Jain's fairness index across tenants"),
              Figure("cycle_ms_10k_jobs_1k_nodes", "one cycle, 10,000 queued, 1,000 nodes, median (ms)",
                     "≤ 100"))),
    Bench("elastic", "The elastic policy in the simulator, on synthetic traces and on Pollux's eight "
          "workloads (../shared/pollux/) at four loads.", (
              *(Figure(f"pollux_workloads_mean_jct_s_{load}", f"Pollux workloads at load {load}: mean JCT (s)")
                for load in ELASTIC_LOADS),
              *(Figure(f"mean_jct_ratio_vs_pollux_published_{load}",
                       f"load {load}: mean JCT ÷ Pollux's published") for load in ELASTIC_LOADS),
              *(Figure(f"tiresias_replay_vs_published_{load}", f"load {load}: Tiresias replayed ÷ published")
                for load in ELASTIC_LOADS),
              Figure("optimizer_ms_500_jobs_4096_gpus", "one optimizer pass, 500 jobs on 4,096 GPUs, median (ms)",
                     "≤ 100"),
              Figure("restarts_per_job", "restarts per job"),
              Figure("mean_jct_ratio_gpu_only_over_elastic", "synthetic: mean JCT GPU-only ÷ elastic"),
              Figure("mean_jct_gain_over_paper_policy", "synthetic: mean JCT gain over the paper's policy"),
              Figure("mean_jct_ratio_elastic_over_fixed_low_load", "synthetic, low load: elastic ÷ fixed"))),
    Bench("hpsearch", "A sweep whose best is known by an exhaustive grid: a two-layer MLP on scikit-learn's "
          "digits, 3 learning rates × 3 widths × 3 batch sizes, 27 epochs, validation accuracy after each. "
          "Experiment manifests parsed by the platform, every decision (grid, random, ASHA's rungs at 1, 3, 9 "
          "and 27 epochs, its pauses and promotions) taken by gpu_scheduler.search and applied by jobs.experiments.Pass's "
          "rules, three trials at a time on a virtual clock. Every epoch is trained for real, nothing replayed; "
          "its learner CPU-seconds measured (one thread). Random search gets ASHA's CPU-seconds of the same "
          "seed and keeps its best completed trial. Median over seeds (ASHA with as many trials as the grid "
          "has points); `bench/results/hpsearch.json` has each seed's.", (
              Figure("asha_cost_ratio_vs_grid", "learner CPU-seconds, ASHA ÷ the grid", "≤ 0.333"),
              Figure("asha_gap_to_best_pp", "ASHA's best below the grid's, validation accuracy (pp)", "≤ 0.5"),
              Figure("random_gap_to_best_pp", "random search's, at ASHA's budget (pp)"),
              Figure("asha_seeds_meeting_targets", "seeds on which ASHA met both targets"),
              Figure("seeds", "seeds ASHA and random search each ran"),
              Figure("asha_epoch_ratio_vs_grid", "epochs trained, ASHA ÷ the grid"),
              Figure("grid_best_val_acc", "the grid's best validation accuracy"),
              Figure("grid_learner_cpu_s", "the grid's learner CPU-seconds"),
              Figure("mismatched_epochs", "retrained epochs whose accuracy differs from the grid's", "= 0"))),
    Bench("trial_load", "One tenant submits a small job every 1.25 s and times each submit, in phases that "
          "alternate: the platform quiet, then another tenant's random search starting its trials (9 s each, "
          "three at a time) at about 20 a minute, a new experiment per loaded phase; p95 of the loaded phases "
          "over the quiet ones.", (
              Figure("submit_p95_ratio_with_trials", "another tenant's submit p95 with trials running ÷ quiet",
                     "≤ 1.20"),
              Figure("submit_p95_ms_quiet", "submit p95, quiet (ms)"),
              Figure("submit_p95_ms_with_trials", "submit p95, with trials (ms)"),
              Figure("trials_per_minute", "trials started per minute during the loaded phases"))),
    *(Bench(name, f"One learner's output through ingest ({backing}) against writing the same lines to a "
            "file; lines lost or duplicated across kills; the reconcile pass after a restart.", (
                Figure("ingest_lines_per_s", "ingest, one learner, sustained lines/s", target),
                Figure("ingest_vs_file_ratio", "ingest ÷ writing a local file"),
                Figure("lost_lines", "lines lost across kills", "= 0"),
                Figure("duplicate_lines", "lines stored twice across kills", "= 0"),
                Figure("reconcile_after_restart_s", "reconcile pass after a restart (s)")))
      for name, backing, target in (("recovery", "the embedded defaults", "≥ 20,000"),
                                    ("recovery.postgresql", "PostgreSQL + Redis", "≥ 50,000"))),
    Bench("ui", "Headless Chromium: a printed log line until the job page shows it, and the jobs page "
          "at 100,000 jobs.", (
              Figure("first_log_line_p95_ms", "log line printed → shown in the browser, p95 (ms)", "≤ 250"),
              Figure("job_list_100k_server_ms", "jobs page at 100,000 jobs, view time median (ms)", "≤ 300"))),
    Bench("concurrency", "Light jobs 1, 10, 40 and 100 at a time (FfDL's Table 1) on the embedded "
          "defaults; each ratio is the mean JCT at that level ÷ one job alone.", (
              Figure("jct_ratio_40_vs_1", "mean JCT, 40 at once ÷ 1", "≤ 1.10"),
              Figure("jct_ratio_100_vs_1", "mean JCT, 100 at once ÷ 1", "≤ 1.25"))),
    Bench("controlplane", "The platform as deploy/kubernetes lays it out (PostgreSQL through PgBouncer), at "
          "1,000 running and 10,000 queued jobs, against an emulated Kubernetes API server.", (
              Figure("submit_p95_ms", "submit through the API, p95 (ms)", "≤ 150"),
              Figure("reconcile_pass_s", "one reconcile pass (s)", "≤ 2"),
              Figure("ingest_p95_ms", "an agent's ingest post, p95 (ms)", "≤ 100"),
              Figure("ws_fanout_p95_ms", "a status change to a websocket client, p95 (ms)", "≤ 250"))),
    Bench("telemetry", "Real agents run sleeping learners side by side, three each with resource sampling "
          "off, every 5 s and every 0.5 s; the agents' own CPU time (their /proc stat, not their children's) "
          "over one window of the learners' run, on minus off, per learner-hour. And the sampler's reading "
          "of a real process burning a core and of one holding 300 MiB, against their own /proc counters (where "
          "other work shares the cores the burner gets less than a core: the figure is how well its share "
          "is read).", (
              Figure("sampling_cpu_s_per_learner_hour", "the agent's CPU seconds per learner-hour, sampling "
                     "every 5 s, on minus off", "≤ 36"),
              Figure("sampling_cpu_s_per_learner_hour_every_0_5_s", "the same, sampling every 0.5 s"),
              Figure("sampling_cpu_ms_per_sample", "the agent's CPU per sample (ms)"),
              Figure("one_core_error_pp_proc", "a process burning a core, read from /proc against its own "
                     "counters, error (percentage points)", "≤ 10"),
              Figure("memory_300mib_error_pct_proc", "300 MiB held, read against /proc's RSS, error (%)", "≤ 5"))),
)


def bench(name):
    return next(b for b in BENCHES if b.name == name)


def figure(bench_name, key):
    return next(f for f in bench(bench_name).figures if f.key == key)


def shown(bench_name, key):
    """The target column of a benchmark's table: "target ≤ 1.10", or "" without one."""
    target = figure(bench_name, key).target
    return f"target {target}" if target else ""
