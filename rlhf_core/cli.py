"""The `rlhf` command.

  rlhf prepare [--set k=v ...]            task data + pretraining corpus in data/, tiny base model in artifacts/base/
  rlhf stage run STAGE [--set k=v ...]    one stage as a Ray job (RAY_ADDRESS, or an embedded local head);
                                          --detach: submit to RAY_ADDRESS and exit
  rlhf pipeline run [--stages ...]        the Prefect flow over the DVC DAG (unchanged stages skipped)
  rlhf pipeline report [--out FILE]       a static HTML page: stages, metrics, curves, champion lineage
  rlhf serve [--port 4200]                local Prefect server (API auth: .prefect/api-auth) + deployments (full, nightly cron)
  rlhf rollouts show PATH                 summary of RL rollout Parquet
  rlhf serve-reward MODEL [--port N]      a reward model over HTTP on 127.0.0.1, bearer token in .rlhf/reward-server.token
                                          (for rl.reward.url + rl.reward.token_file; OpenRLHF clients: /get_reward)
  rlhf lineage show PATH                  the artifact's ancestry back to raw data, code and config
  rlhf lineage verify PATH                re-hash the whole chain; non-zero exit on any mismatch
  rlhf config show STAGE [--set k=v ...]  the resolved config of a stage, as JSON
  rlhf data check PATH --kind KIND        validate a user data file; rejects go to a file

Overrides are dotted (`--set prepare.task.max_value=49`); an unknown key or a wrong type is an
error listing the valid keys.  Heavy imports happen inside the commands so `--help` is instant.
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import sys

from flows.overrides import check_overrides
from rlhf_core import registry
from rlhf_core.config import ConfigError, config_hash, config_to_dict, load_config
from rlhf_core.data.io import DataError, load_rows
from rlhf_core.runtime import stage_lock

STAGE_NAMES = ", ".join(registry.BY_NAME)


def _stage_module(name: str):
    """The module of stage `name` (`rl@rlhf`: a variant of rl, params.yaml rl_variants.rlhf)."""
    try:
        return importlib.import_module(registry.get(name).module)
    except KeyError as e:
        raise SystemExit(f"rlhf: {e.args[0]}") from None


def _resolve(stage: str, args) -> object:
    module = _stage_module(stage)
    return load_config(module.Config, stage, args.params, args.set)


def cmd_prepare(args) -> int:
    cfg = _resolve("prepare", args)
    _stage_module("prepare").run(cfg)
    return 0


def _sigterm_as_interrupt() -> None:
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def cmd_stage_run(args) -> int:
    # per command: urllib.request, http.client and ssl (~20 ms, the Ray job client), which `--help` and the other commands do without
    from rlhf_core.runtime.cluster import cluster_job_address, job_server

    # per command: the job submission, which imports cluster (the same ~20 ms)
    from rlhf_core.runtime.jobs import JobFailed, Secrets, forward_env, submit_and_wait, submit_detached, write_resolved_config

    cfg = _resolve(args.stage, args)
    address = cluster_job_address()
    if args.detach and not address:
        raise SystemExit("rlhf: --detach needs a cluster at RAY_ADDRESS: an embedded Ray head stops with this command")
    try:  # fail fast, before anything is written or started; the job's own lock is the authority
        stage_lock.check(cfg.output_dir, args.stage)
    except stage_lock.StageLocked as e:
        print(f"rlhf: {e}", file=sys.stderr)
        return 3
    path = write_resolved_config(args.stage, config_to_dict(cfg), cfg.output_dir)  # credentials redacted
    # ... and handed to the job in a 0600 file by path, never through its runtime_env
    env, secrets = forward_env(), Secrets.of(cfg)
    if args.detach:
        job_id = submit_detached(address, args.stage, path, env, secrets)
        print(f"submitted {args.stage} as Ray job {job_id} (detached: it runs on without this command)\n"
              f"  follow: ray job logs --address {address} --follow {job_id}\n"
              f"  status: ray job status --address {address} {job_id}\n"
              f"  stop:   ray job stop --address {address} {job_id}")
        return 0
    _sigterm_as_interrupt()  # a terminated command stops its Ray job (and embedded head) like Ctrl-C
    try:
        # killed outright (SIGKILL, OOM), the command still takes its work along: a watchdog
        # stops the job on a cluster; an embedded head's watchdog kills the head with every job in it
        with job_server() as job_address:
            submit_and_wait(job_address, args.stage, path, env, guard=bool(address), secrets=secrets)
    except JobFailed as e:
        print(f"rlhf: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_lineage_show(args) -> int:
    from rlhf_core.artifacts.lineage import render  # per command: manifest's importlib.metadata (~17 ms)

    print(render(args.path))
    return 0


def cmd_lineage_verify(args) -> int:
    from rlhf_core.artifacts.lineage import verify_chain  # per command: manifest's importlib.metadata (~17 ms)

    problems = verify_chain(args.path)
    for p in problems:
        print(f"MISMATCH {p}", file=sys.stderr)
    print(f"{args.path}: {'FAILED, ' + str(len(problems)) + ' problem(s)' if problems else 'lineage intact'}")
    return 1 if problems else 0


def cmd_pipeline_run(args) -> int:
    """The Prefect flow, run in this process (ephemeral Prefect API unless PREFECT_API_URL is set)."""
    # a loaded 2-core machine can take longer than Prefect's default 20 s to start the
    # temporary API server; a slow start must not fail the pipeline
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    # here too, not only in the flow: Prefect records a flow run's parameters before its body runs
    check_overrides(args.set, args.repo, from_deployment=False)
    # heavy: Prefect (seconds), which reads its settings when imported: after the setdefault above
    from flows.pipeline import alignment_pipeline

    stages = [s for s in (args.stages or "").split(",") if s] or None
    _sigterm_as_interrupt()  # the flow run is marked crashed and the running stage is stopped
    try:
        result = alignment_pipeline(stages=stages, overrides=args.set, repo=args.repo, promote=not args.no_promote,
                                    promotion_margin=args.margin, push=not args.no_push, retries=args.retries)
    except Exception as e:  # the flow run is already marked Failed in Prefect; say why here
        print(f"rlhf: pipeline failed: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2, default=str))
    return 0


def cmd_pipeline_report(args) -> int:
    from flows.report import write  # per command: artifacts.lineage (importlib.metadata, ~17 ms) for the champion's lineage

    path = write(args.repo, args.out)
    print(f"wrote {path} (open it in a browser)")
    return 0


def cmd_serve(args) -> int:
    from flows.serve import serve  # per command: urllib.request and subprocess (~17 ms) for the local Prefect server

    serve(args.repo, args.port, args.cron, auth=not args.no_auth, allow_overrides=args.allow_override)
    return 0


def cmd_rollouts_show(args) -> int:
    from rlhf_core.rollout.parquet import summarize  # heavy: torch (the batch type) and pyarrow

    print(summarize(args.path, args.samples))
    return 0


def cmd_serve_reward(args) -> int:
    from rlhf_core.rollout.reward_server import serve  # per command: http.server (~20 ms); the model it serves imports torch

    serve(args.model, args.host, args.port, token_file=args.token_file, auth=not args.no_auth)
    return 0


def cmd_config_show(args) -> int:
    cfg = _resolve(args.stage, args)
    print(json.dumps({"stage": args.stage, "config_sha256": config_hash(cfg), "config": config_to_dict(cfg)}, indent=2))
    return 0


def cmd_data_check(args) -> int:
    rejects = args.rejects or f"{args.path}.rejects.jsonl"
    result = load_rows(args.path, args.kind, rejects_path=rejects, max_chars=args.max_chars, max_reject_ratio=args.max_reject_ratio)
    print(f"{args.path}: {len(result.rows)} valid / {result.num_total} rows, {result.num_rejected} rejected -> {rejects}")
    for reason, n in result.reasons.most_common():
        print(f"  {n:6d}  {reason}")
    return 0


def _with_config(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="dotted config override, repeatable")
    p.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    return p


def _inspection_commands(sub) -> None:
    """rollouts, serve-reward, config, data: the commands around the pipeline."""
    rollouts = sub.add_parser("rollouts", help="inspect RL rollouts").add_subparsers(dest="rollouts_command", required=True)
    p = rollouts.add_parser("show", help="per-step reward/length/KL summary and a few samples of rollout Parquet")
    p.add_argument("path", help="artifacts/rl/rollouts or one step_NNNNNN.parquet")
    p.add_argument("--samples", type=int, default=3, help="samples to print from the last step")
    p.set_defaults(func=cmd_rollouts_show)

    p = sub.add_parser("serve-reward", help="serve a reward model over HTTP (POST /score; OpenRLHF's POST /get_reward) for rl.reward.url")
    p.add_argument("model", help="reward model dir, e.g. artifacts/rm/model")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback; plain HTTP: put TLS in front to expose it)")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--token-file", default=".rlhf/reward-server.token",
                   help="bearer token file (0600), made at the first start and reused; clients: rl.reward.token_file=PATH "
                        "(default: .rlhf/reward-server.token)")
    p.add_argument("--no-auth", action="store_true", help="serve without a token (anyone who can reach the port may score)")
    p.set_defaults(func=cmd_serve_reward)

    config = sub.add_parser("config", help="inspect configs").add_subparsers(dest="config_command", required=True)
    p = _with_config(config.add_parser("show", help="print a stage's resolved config and its hash"))
    p.add_argument("stage", help=f"one of: {STAGE_NAMES}; a variant of params.yaml's STAGE_variants: STAGE@NAME (e.g. rl@rlhf)")
    p.set_defaults(func=cmd_config_show)

    data = sub.add_parser("data", help="inspect data").add_subparsers(dest="data_command", required=True)
    p = data.add_parser("check", help="validate a JSONL/Parquet/HF-datasets file; write rejects with reasons")
    p.add_argument("path")
    p.add_argument("--kind", required=True, choices=["sft", "pref", "rl", "unpaired"],
                   help="sft: prompt,response; pref: prompt,chosen,rejected; rl: prompt,label")
    p.add_argument("--rejects", help="rejects file (default: PATH.rejects.jsonl)")
    p.add_argument("--max-chars", type=int, default=4096)
    p.add_argument("--max-reject-ratio", type=float, default=0.05)
    p.set_defaults(func=cmd_data_check)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhf", description="RLHF pipeline: prepare -> sft -> rm/dpo -> rl")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = _with_config(sub.add_parser("prepare", help="write task data to data/ and the tiny base model to artifacts/base/"))
    p.set_defaults(func=cmd_prepare)

    stage = sub.add_parser("stage", help="run pipeline stages").add_subparsers(dest="stage_command", required=True)
    p = _with_config(stage.add_parser("run", help="run one stage as a Ray job; resumes from its last checkpoint"))
    p.add_argument("stage", help=f"one of: {STAGE_NAMES}; a variant of params.yaml's STAGE_variants: STAGE@NAME (e.g. rl@rlhf)")
    p.add_argument("--detach", action="store_true",
                   help="with RAY_ADDRESS: submit, print the job id and how to follow it, and exit; the job runs on "
                        "(without it, the job is stopped when this command ends or dies)")
    p.set_defaults(func=cmd_stage_run)

    lineage = sub.add_parser("lineage", help="audit artifacts").add_subparsers(dest="lineage_command", required=True)
    p = lineage.add_parser("show", help="print the ancestry tree of an artifact (or a model dir inside one)")
    p.add_argument("path")
    p.set_defaults(func=cmd_lineage_show)
    p = lineage.add_parser("verify", help="re-hash the artifact and every ancestor; exit 1 naming any mismatch")
    p.add_argument("path")
    p.set_defaults(func=cmd_lineage_verify)

    pipeline = sub.add_parser("pipeline", help="the Prefect flow over the DVC pipeline").add_subparsers(dest="pipeline_command", required=True)
    p = pipeline.add_parser("run", help="run alignment-pipeline now: each stage via `dvc repro -s` (unchanged ones skipped), then the promotion gate")
    p.add_argument("--stages", help="comma-separated subset, e.g. rl@rlvr (default: every stage of dvc.yaml, in order)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="param override, written into params.yaml")
    p.add_argument("--repo", default=".", help="project directory (default: .)")
    p.add_argument("--margin", type=float, default=0.0, help="promotion: accept if eval/accuracy >= champion - margin")
    p.add_argument("--no-promote", action="store_true", help="skip the promotion gate")
    p.add_argument("--no-push", action="store_true", help="do not push outputs to the DVC remote")
    p.add_argument("--retries", type=int, default=1, help="retries per stage for transient failures (default 1)")
    p.set_defaults(func=cmd_pipeline_run)
    p = pipeline.add_parser("report", help="one static HTML page: the stage DAG with each stage's state, headline metrics and curves, "
                                           "and the champion's lineage")
    p.add_argument("--repo", default=".", help="project directory (default: .)")
    p.add_argument("--out", help="HTML file to write (default: REPO/reports/pipeline.html)")
    p.set_defaults(func=cmd_pipeline_report)

    p = sub.add_parser("serve", help="local Prefect server (127.0.0.1, SQLite) + deployments alignment-pipeline/full and /nightly")
    p.add_argument("--repo", default=".")
    p.add_argument("--port", type=int, default=4200)
    p.add_argument("--cron", default="0 2 * * *", help="nightly schedule (default 02:00)")
    p.add_argument("--no-auth", action="store_true",
                   help="start the local Prefect server without API auth (default: basic auth, the string in REPO/.prefect/api-auth)")
    p.add_argument("--allow-override", action="append", default=[], metavar="KEY",
                   help="let deployment flow runs override KEY (e.g. rl.reward.file, or reward_file for every section), which is "
                        "refused by default for keys naming code, files, URLs or paths outside the repo; repeatable")
    p.set_defaults(func=cmd_serve)

    _inspection_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    if not args.verbose:  # Prefect's API client logs every request at INFO: one line per batch of shipped logs
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"rlhf: config error: {e}", file=sys.stderr)
        return 2
    except DataError as e:
        print(f"rlhf: data error: {e}", file=sys.stderr)
        return 1
    except FileNotFoundError as e:
        print(f"rlhf: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
