"""One all-reduce across the GPUs, the collective that tensor parallelism and multi-GPU training depend on.

`python -m eagle_pipeline.allreduce_check WORLD_SIZE` does what docs/gpu_host.md, "The preflight", describes and
prints one line: exit 0 when every rank got the expected sum, 1 otherwise. `--backend gloo` runs the same on CPU
processes, which is how it is tested on hosts without GPUs.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time

# 32 MiB of float32 per rank: larger than NCCL's buffer per channel, so the transport moves it in several steps.
ELEMENTS = 8 * 1024 * 1024
# A rank that never joins would otherwise leave the others waiting in the rendezvous for NCCL's default 10 min.
INIT_TIMEOUT_S = 120


def expected_sum(world_size: int) -> float:
    return world_size * (world_size + 1) / 2


def check_rank(rank: int, world_size: int, backend: str, init_file: str) -> None:
    """One rank: join the group, all-reduce, compare. Raises when the result is wrong."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=INIT_TIMEOUT_S))
    try:
        tensor = torch.full((ELEMENTS,), float(rank + 1), dtype=torch.float32, device=device)
        dist.all_reduce(tensor)
        wrong = int((tensor != expected_sum(world_size)).sum())
        if wrong:
            raise RuntimeError(f"rank {rank}: {wrong} of {ELEMENTS} elements differ from {expected_sum(world_size):g} "
                               f"(first element {tensor[0].item():g})")
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle_pipeline.allreduce_check",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("world_size", type=int, help="processes, one per GPU (GPUs 0..N-1 of CUDA_VISIBLE_DEVICES)")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl", help="gloo: CPU processes, no GPU")
    args = parser.parse_args(argv)
    if args.world_size < 1:
        parser.error("world_size must be at least 1")

    import torch
    import torch.multiprocessing as mp

    what = (f"{args.world_size} GPU{'s' if args.world_size != 1 else ''}" if args.backend == "nccl"
            else f"{args.world_size} CPU processes")
    if args.backend == "nccl" and torch.cuda.device_count() < args.world_size:
        print(f"error: all-reduce across {what}: torch sees {torch.cuda.device_count()} GPUs", file=sys.stderr)
        return 1
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="allreduce-") as folder:
        try:
            mp.spawn(check_rank, args=(args.world_size, args.backend, os.path.join(folder, "rendezvous")),
                     nprocs=args.world_size, join=True)
        except Exception as e:  # a rank's exception arrives with its traceback; its last line says what went wrong
            said = [line.strip() for line in str(e).splitlines() if line.strip()]
            print(f"error: all-reduce ({args.backend}) across {what} failed: {said[-1] if said else type(e).__name__}",
                  file=sys.stderr)
            return 1
    print(f"all-reduce ({args.backend}) across {what}: every rank got {expected_sum(args.world_size):g}, "
          f"{time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
