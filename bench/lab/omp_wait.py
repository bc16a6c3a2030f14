"""Investigation: how OpenMP's wait policy and the thread count change a training step of the embedded target,
on a quiet machine and beside one busy single-thread process.

    python -m bench.lab.omp_wait --steps 12 --out bench/results/cpu-omp-wait.json

Each case runs in a fresh process (OpenMP reads OMP_WAIT_POLICY once, when torch loads it): the embedded
default's target (conf/target/tiny.yaml), random tokens, AdamW, the resolved training autocast, the median
seconds of `--steps` steps after 3 warm-up steps. The busy neighbour is a pure-Python spin loop.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CASES = [("2 threads, OMP_WAIT_POLICY unset (spin)", 2, None), ("2 threads, PASSIVE", 2, "PASSIVE"),
         ("2 threads, ACTIVE", 2, "ACTIVE"), ("1 thread", 1, None)]


def child(threads: int, steps: int, autocast: str | None) -> dict:
    import statistics

    import torch
    from omegaconf import OmegaConf

    from models import TargetConfig, Transformer

    torch.set_num_threads(threads)
    conf = OmegaConf.load(ROOT / "conf/target/tiny.yaml")
    model = {k: v for k, v in OmegaConf.to_container(conf.model, resolve=False).items()
             if k not in ("vocab_size", "max_seq_len", "tap_layers")}
    torch.manual_seed(0)
    cfg = TargetConfig(vocab_size=conf.tokenizer.vocab_size, max_seq_len=conf.max_seq_len, **model)
    net = Transformer(cfg).train()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    b, t = int(conf.train.batch_size), int(conf.train.seq_len)
    times = []
    for i in range(steps + 3):
        x = torch.randint(0, cfg.vocab_size, (b, t + 1))
        s = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast == "bfloat16"):
            logits = net(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 3:
            times.append(time.perf_counter() - s)
    return {"s_per_step": round(statistics.median(times), 3), "tokens_per_s": round(b * t / statistics.median(times))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        threads, steps, autocast = int(args.child[0]), int(args.child[1]), args.child[2]
        print(json.dumps(child(threads, steps, None if autocast == "fp32" else autocast)))
        return 0
    import torch

    from pipeline import hardware

    autocast = hardware.resolve_autocast("auto", "cpu", "bench") or "fp32"
    rows = []
    for busy in (False, True):
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
        try:
            for name, threads, policy in CASES:
                env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "KMP_BLOCKTIME")}
                if policy:
                    env["OMP_WAIT_POLICY"] = policy
                out = subprocess.run([sys.executable, "-m", "bench.lab.omp_wait", "--child", str(threads),
                                      str(args.steps), autocast], env=env, cwd=ROOT, capture_output=True,
                                     text=True, check=True).stdout
                row = {"case": name, "busy_neighbour": busy, **json.loads(out.strip().splitlines()[-1])}
                print(row, flush=True)
                rows.append(row)
        finally:
            if spinner:
                spinner.kill()
    result = {"what": "training step of the embedded target by OpenMP wait policy and threads",
              "cpu": hardware.cpu_fingerprint()["cpu"], "capability": torch.backends.cpu.get_cpu_capability(),
              "autocast": autocast, "steps": args.steps, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
