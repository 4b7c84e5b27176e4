"""How often a two-process gloo run dies at exit, by how its processes end (tp.finish_distributed's reason).

    python scripts/tp_exit_check.py --runs 20 --end none      # leave to the interpreter's teardown
    python scripts/tp_exit_check.py --runs 20 --end destroy   # barrier, destroy_process_group(), then teardown
    python scripts/tp_exit_check.py --runs 20 --end finish    # tp.finish_distributed(): barrier, os._exit

Each run is `torchrun --nproc_per_node 2` of this file's worker: 20 all-reduces (functional collectives, as tp.py's),
then the chosen end. Prints the runs that failed and the abort line a process printed.
"""
import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worker(end: str):
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    sys.path.insert(0, str(ROOT))
    from tp import finish_distributed
    dist.init_process_group("gloo")
    x = torch.ones(1000)
    for _ in range(20):
        x = funcol.all_reduce(x, "sum", dist.group.WORLD) / 2
    if dist.get_rank() == 1:
        time.sleep(0.2)  # the processes reach their end at different times, as a real run's do
    if end == "destroy":
        dist.barrier()
        dist.destroy_process_group()
    elif end == "finish":
        finish_distributed()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--end", choices=["none", "destroy", "finish"], default="finish")
    p.add_argument("--port", type=int, default=29433)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.end)
    if args.runs < 1:
        p.error("--runs must be at least 1")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    failed = 0
    for i in range(args.runs):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(args.port),
               __file__, "--worker", "--end", args.end]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if r.returncode:
            failed += 1
            why = next((line for line in r.stderr.splitlines() if "terminate" in line or "Error" in line), "?")
            print(f"run {i + 1}: exit {r.returncode}: {why}")
    print(f"--end {args.end}: {failed} of {args.runs} runs failed")


if __name__ == "__main__":
    main()
