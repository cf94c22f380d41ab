"""Run many `bench/lab_chain.py` configs in parallel (one line of arguments each) and summarise.

  python bench/lab_sweep.py CONFIGS.txt OUT.jsonl [--parallel 12] [--budget-s 480]
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def run(line: str, deadline: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).with_name("lab_chain.py")), *line.split(), "--threads", "1"]
    left = deadline - time.time()
    if left < 20:
        return {"tag": line, "error": "skipped: budget"}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
    except subprocess.TimeoutExpired:
        return {"tag": line, "error": "timeout"}
    rows = [x for x in p.stdout.splitlines() if x.startswith("{")]
    return json.loads(rows[-1]) if rows else {"tag": line, "error": p.stderr[-800:]}


def main():
    configs = [line.strip() for line in Path(sys.argv[1]).read_text().splitlines() if line.strip() and not line.startswith("#")]
    out = Path(sys.argv[2])
    par = int(sys.argv[sys.argv.index("--parallel") + 1]) if "--parallel" in sys.argv else 12
    budget = float(sys.argv[sys.argv.index("--budget-s") + 1]) if "--budget-s" in sys.argv else 480
    deadline = time.time() + budget
    with ThreadPoolExecutor(par) as ex, open(out, "a") as f:
        for res in ex.map(lambda line: run(line, deadline), configs):
            f.write(json.dumps(res) + "\n")
            f.flush()
            if "error" in res:
                print("ERR", res["tag"], res["error"][-300:], flush=True)
            else:
                print(f"{res['tag']:<40} base {res.get('acc_base', -1):.3f} sft {res['acc_sft']:.3f} curve {res['sft_curve']} "
                      f"lp {res['sft_logprob_rank']:.2f} rm {res.get('rm')} rmc {res.get('rm_curve')} pt_loss {res.get('pt_loss')} "
                      f"sat {res['diag_sft']['attn_saturated']} norm {res['diag_sft']['resid_norm']}", flush=True)


if __name__ == "__main__":
    main()
