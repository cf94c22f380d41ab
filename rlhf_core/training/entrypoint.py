"""`python -m stages.STAGE --config resolved.json`: the Ray job entrypoint every stage's `main()` calls."""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
from pathlib import Path

from rlhf_core.config import from_dict, restore_secrets
from rlhf_core.runtime import stage_lock
from rlhf_core.runtime.env import SECRETS_FILE, read_secrets_file

log = logging.getLogger("rlhf.stage")


def stage_main(cls, section: str, run, argv: list[str] | None = None, needs_ray: bool = True) -> None:
    """`python -m stages.STAGE --config resolved.json`: the Ray job entrypoint.  A training stage
    takes its output directory's lock first (`runtime/stage_lock.py`): one writer per directory."""
    parser = argparse.ArgumentParser(prog=f"python -m stages.{section}")
    parser.add_argument("--config", required=True, help="resolved config JSON written by `rlhf stage run`")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", datefmt="%H:%M:%S", stream=sys.stdout)
    raw = Path(args.config).read_bytes()
    data = json.loads(raw)
    # the file has credentials redacted; `rlhf stage run` passed the real ones in a 0600 file
    # (runtime/env.py), with any secret variables the job was asked to forward
    secrets = read_secrets_file()
    os.environ.update(secrets["env"])
    cfg = from_dict(cls, restore_secrets(data.get("config", data), secrets["config"]), prefix=f"{section}.")
    output_dir = getattr(cfg, "output_dir", None) if needs_ray else None  # prepare writes data/ and base/ in-process
    if output_dir:
        try:
            stage_lock.acquire(output_dir, section)
        except stage_lock.StageLocked as e:  # the reason, not a traceback, is what the user needs
            print(f"rlhf: {e}", file=sys.stderr, flush=True)
            raise SystemExit(3) from None
        expected = os.environ.get("RLHF_CONFIG_SHA256")
        if expected and hashlib.sha256(raw).hexdigest() != expected:
            # another `rlhf stage run` on this directory rewrote the file before we held the lock
            stage_lock.release(output_dir)
            raise RuntimeError(f"{args.config} is not the config this job was submitted with: another `rlhf stage run` on "
                               f"{output_dir} replaced it. One writer per output directory; rerun when that run is done.")
    try:
        if not needs_ray:
            run(cfg)
            return
        import ray

        ray.init(address="auto" if os.environ.get("RAY_ADDRESS") else None, logging_level=logging.WARNING)
        try:
            run(cfg)
        finally:
            ray.shutdown()
    finally:
        if output_dir:
            stage_lock.release(output_dir)
        if os.environ.get(SECRETS_FILE):  # read by now (driver and actors): gone with the job
            Path(os.environ[SECRETS_FILE]).unlink(missing_ok=True)
