"""Data-parallel training of the digits classifier with torch.distributed (gloo, CPU).

The multi-node example workload (issue 9): the same task as ``train_digits.py`` (a
one-hidden-layer MLP on scikit-learn's bundled 8x8 digits), trained by ``WORLD_SIZE`` processes
that each compute the gradient of their share of every global batch and average it with an
all-reduce (``DistributedDataParallel``). See examples/README.md for the whole contract.

**Launch.** One process per rank, rendezvous through ``env://``: ``MASTER_ADDR``,
``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``. A gpufleet gang starts one process per member node
with exactly these (plus ``NODE_RANK``, ``LOCAL_WORLD_SIZE``, ``GPUFLEET_GANG_SIZE``), so
``WORLD_SIZE`` is the number of nodes. The same file runs unchanged under ``torchrun``, which
sets the same variables for each worker it spawns (``--nproc-per-node N`` for N processes per
node). Without ``WORLD_SIZE`` (or with 1) it trains in one process, without torch.distributed.

**Equivalence to one process.** Every rank draws the same global batch of ``--batch-size``
indices from the same seeded generator and takes the slice ``batch[rank::world]``; its loss is
the *sum* over its slice times ``world / batch_size``, so the gradient DDP averages is exactly the
full batch's mean gradient. The trajectory is the 1-process one up to floating-point summation
order (float64 throughout), whatever the world size, and a checkpoint taken at one world size
resumes at another.

**Stops.** SIGTERM only sets a flag; every step the ranks all-reduce (MAX) their flags, so a
SIGTERM that reaches any one rank stops *all* of them after the same step: each writes the
checkpoint, creates ``$GPUFLEET_CHECKPOINT_DONE`` (the checkpoint handshake: its agent then
stops it without waiting out the grace) and exits 143. A rank that dies (SIGKILL, crash) makes the others' next collective
fail: they print the error and exit 1 (the platform then stops and retries the whole gang).

**Checkpoints.** Every rank writes the same ``ckpt.pt`` (model, optimizer, step, generator
state) to its own ``GPUFLEET_CHECKPOINT_DIR`` every ``--checkpoint-every`` steps and on SIGTERM,
so whichever member's checkpoint the platform hands back resumes the job. On resume each rank
loads ``$GPUFLEET_RESUME_FROM/ckpt.pt`` if it has one; the ranks then agree on the most advanced
one (highest step, lowest rank on ties) and broadcast it, so members with no or older
checkpoints follow. Rank 0 writes the final ``model.pt`` and ``metrics.json`` artifacts.

Exit codes: 0 done; 143 stopped by SIGTERM after checkpointing; ``--fail-exit-code`` (3) for the
injected failure of ``--fail-at-step`` on ``--fail-rank``; 1 a peer rank failed or another error.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

CKPT_NAME = "ckpt.pt"
EXIT_SIGTERM = 143  # 128 + SIGTERM(15): "stopped on request, checkpoint saved"
EXIT_PEER_FAILED = 1

_stop_requested = False


def _on_sigterm(signum: int, frame: object) -> None:  # noqa: ARG001 (signal handler signature)
    global _stop_requested
    _stop_requested = True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="total SGD steps (default 300)")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    p.add_argument("--lr", type=float, default=0.2, help="SGD learning rate")
    p.add_argument("--hidden", type=int, default=64, help="hidden units")
    p.add_argument("--batch-size", type=int, default=64, help="global batch, all ranks together")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.01, help="seconds slept per step")
    p.add_argument("--fail-at-step", type=int, default=None, help="exit non-zero at this step")
    p.add_argument("--fail-rank", type=int, default=0, help="the rank --fail-at-step fails")
    p.add_argument("--fail-exit-code", type=int, default=3)
    p.add_argument(
        "--dist-timeout-s",
        type=float,
        default=120.0,
        help="rendezvous and collective timeout (a peer that never arrives or hangs)",
    )
    return p.parse_args(argv)


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    return int(raw) if raw.strip() else default


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _on_sigterm)  # before the slow imports
    args = parse_args(argv)
    started = time.monotonic()

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)  # a CPU example: one core per rank, no oversubscription
    world, rank = env_int("WORLD_SIZE", 1), env_int("RANK", 0)
    distributed = world > 1
    if distributed:
        dist.init_process_group(
            "gloo",
            init_method="env://",
            world_size=world,
            rank=rank,
            timeout=timedelta(seconds=args.dist_timeout_s),
        )
    ckpt_dir = Path(os.environ.get("GPUFLEET_CHECKPOINT_DIR") or "checkpoints")
    art_dir = Path(os.environ.get("GPUFLEET_ARTIFACTS_DIR") or "artifacts")
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        art_dir.mkdir(parents=True, exist_ok=True)
    job_id, run_id = os.environ.get("GPUFLEET_JOB_ID", ""), os.environ.get("GPUFLEET_RUN_ID", "")
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
    log = _logger(rank)
    log(
        f"job {job_id or '-'} run {run_id or '-'}: rank {rank}/{world} "
        f"(node rank {os.environ.get('NODE_RANK', '-')}, master "
        f"{os.environ.get('MASTER_ADDR', '-')}:{os.environ.get('MASTER_PORT', '-')}) on "
        + (f"GPUs {gpus}" if gpus else "CPU (CUDA_VISIBLE_DEVICES unset)")
    )

    x_tr, y_tr, x_te, y_te = load_data(args.seed)
    x_tr_t, y_tr_t = torch.tensor(x_tr), torch.tensor(y_tr)
    x_te_t, y_te_t = torch.tensor(x_te), torch.tensor(y_te)

    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed)

    step = load_checkpoint(os.environ.get("GPUFLEET_RESUME_FROM", ""), model, opt, gen, log)
    start_step: int | None = None
    loss_sum = nn.CrossEntropyLoss(reduction="sum")
    report_every = max(1, args.steps // 10)

    def save() -> None:
        save_checkpoint(ckpt_dir / CKPT_NAME, model, opt, gen, step, world)

    try:
        if distributed:
            step = agree_on_checkpoint(step, model, opt, gen, rank, world, log)
        start_step = step if step > 0 else None
        if start_step is not None:
            log(f"resumed from step {start_step}")
        net: nn.Module = DistributedDataParallel(model) if distributed else model
        while step < args.steps:
            if stop_agreed(distributed):
                save()
                if os.environ.get("GPUFLEET_CHECKPOINT_DONE"):  # the handshake: stop me now
                    Path(os.environ["GPUFLEET_CHECKPOINT_DONE"]).touch()
                log(f"SIGTERM: checkpointed step {step}, exiting {EXIT_SIGTERM}")
                return EXIT_SIGTERM
            batch = torch.randint(0, len(y_tr_t), (args.batch_size,), generator=gen)
            mine = batch[rank::world]
            opt.zero_grad(set_to_none=True)
            # Sum over my slice x world / global batch: DDP's average over ranks is then the
            # global batch's mean gradient, for any split of the batch.
            loss = loss_sum(net(x_tr_t[mine]), y_tr_t[mine]) * (world / args.batch_size)
            loss.backward()
            opt.step()
            step += 1
            if step % args.checkpoint_every == 0:
                save()
            if step % report_every == 0 or step == args.steps:
                tl, ta = evaluate(model, x_tr_t, y_tr_t)
                log(f"step {step}/{args.steps} loss={tl:.3f} train_acc={ta:.3f}")
            if step == args.fail_at_step and rank == args.fail_rank:
                log(f"injected failure at step {step}", err=True)
                return int(args.fail_exit_code)
            time.sleep(args.step_sleep)
        save()
        if distributed:
            dist.barrier()
    except (RuntimeError, dist.DistError) as exc:  # a peer died or the rendezvous timed out
        log(f"distributed step failed at step {step}: {str(exc).splitlines()[0]}", err=True)
        return EXIT_PEER_FAILED

    if rank == 0:
        write_artifacts(
            art_dir,
            model,
            x_tr_t,
            y_tr_t,
            x_te_t,
            y_te_t,
            {
                "steps": step,
                "resumed_from_step": start_step,
                "world_size": world,
                "wall_s": round(time.monotonic() - started, 3),
                "seed": args.seed,
                "job_id": job_id or None,
                "run_id": run_id or None,
            },
            log,
        )
    if distributed:
        dist.destroy_process_group()
    return 0


def _logger(rank: int) -> Any:
    def log(msg: str, err: bool = False) -> None:
        print(f"[rank {rank}] {msg}", file=sys.stderr if err else sys.stdout, flush=True)

    return log


def load_data(seed: int) -> tuple[Any, Any, Any, Any]:
    """(x_train, y_train, x_test, y_test): scikit-learn's digits (1,797 8x8 images flattened to
    64 floats in [0, 1], labels 0-9), split 80/20 stratified by class with ``seed``.

    Reads the CSV that scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``) with numpy
    instead of importing scikit-learn, which costs about 1.5 s of CPU per rank; falls back to
    ``sklearn.datasets.load_digits`` where that file is not found.
    """
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec("sklearn")  # locates the package without importing it
    csv = None
    for root in (spec.submodule_search_locations or []) if spec else []:
        if (Path(root) / "datasets" / "data" / "digits.csv.gz").is_file():
            csv = Path(root) / "datasets" / "data" / "digits.csv.gz"
    if csv is not None:
        data = np.loadtxt(csv, delimiter=",")
        x, y = data[:, :-1], data[:, -1].astype(np.int64)
    else:
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
    rng = np.random.default_rng(seed)
    test = np.concatenate(
        [
            rng.permutation(np.flatnonzero(y == c))[: round(0.2 * int((y == c).sum()))]
            for c in range(10)
        ]
    )
    is_test = np.zeros(len(y), dtype=bool)
    is_test[test] = True
    x = x / 16.0
    return x[~is_test], y[~is_test], x[is_test], y[is_test]


def stop_agreed(distributed: bool) -> bool:
    """True when any rank has been asked to stop (SIGTERM): all-reduce MAX of the flags, so
    every rank stops after the same step."""
    if not distributed:
        return _stop_requested
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1.0 if _stop_requested else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


def evaluate(model: Any, x: Any, y: Any) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of ``model`` on ``x`` (n, 64), ``y`` (n,)."""
    import torch

    with torch.no_grad():
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        acc = (logits.argmax(dim=1) == y).double().mean()
    return float(loss), float(acc)


def atomic_torch_save(obj: Any, path: Path) -> None:
    """Write ``path`` so a reader sees the old file or the new one, never a torn one (several
    local ranks may write the same file: each uses its own temporary name)."""
    import torch

    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(path: Path, model: Any, opt: Any, gen: Any, step: int, world: int) -> None:
    atomic_torch_save(
        {
            "step": step,
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "generator": gen.get_state(),
            "world_size": world,
        },
        path,
    )


def load_checkpoint(resume_dir: str, model: Any, opt: Any, gen: Any, log: Any) -> int:
    """Load ``resume_dir/ckpt.pt`` into model, optimizer and generator; its step, or 0."""
    import torch

    path = Path(resume_dir) / CKPT_NAME
    if not resume_dir or not path.is_file():
        return 0
    ckpt = torch.load(path, weights_only=True)
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as exc:
        sys.exit(f"checkpoint {path} does not fit this model (different --hidden?): {exc}")
    opt.load_state_dict(ckpt["optimizer"])
    gen.set_state(ckpt["generator"])
    log(f"loaded checkpoint {path}: step {ckpt['step']} (world size {ckpt['world_size']})")
    return int(ckpt["step"])


def agree_on_checkpoint(
    step: int, model: Any, opt: Any, gen: Any, rank: int, world: int, log: Any
) -> int:
    """Make every rank continue from the most advanced checkpoint any rank loaded: all-gather
    the steps, pick the highest (lowest rank on ties), broadcast its parameters and generator
    state from that rank. Returns the agreed step."""
    import torch
    import torch.distributed as dist

    steps = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(steps, torch.tensor([step], dtype=torch.int64))
    values = [int(t.item()) for t in steps]
    src = max(range(world), key=lambda r: (values[r], -r))
    for p in model.state_dict().values():
        dist.broadcast(p, src=src)
    state = gen.get_state()
    dist.broadcast(state, src=src)
    gen.set_state(state)
    if values[src] and values[rank] != values[src]:
        log(f"took rank {src}'s checkpoint at step {values[src]} (mine: {values[rank]})")
    # Plain SGD has no optimizer state to share; a momentum optimizer would broadcast it too.
    del opt
    return values[src]


def write_artifacts(
    art_dir: Path,
    model: Any,
    x_tr: Any,
    y_tr: Any,
    x_te: Any,
    y_te: Any,
    extra: dict[str, Any],
    log: Any,
) -> None:
    """Rank 0: ``model.pt`` (state dict) and ``metrics.json``, each written atomically."""
    test_loss, test_acc = evaluate(model, x_te, y_te)
    train_loss, train_acc = evaluate(model, x_tr, y_tr)
    atomic_torch_save(model.state_dict(), art_dir / "model.pt")
    metrics = {
        "test_samples": len(y_te),
        "test_acc": test_acc,
        "test_loss": test_loss,
        "train_acc": train_acc,
        "train_loss": train_loss,
        **extra,
    }
    tmp = art_dir / ".metrics.json.tmp"
    tmp.write_text(json.dumps(metrics, indent=2) + "\n")
    os.replace(tmp, art_dir / "metrics.json")
    log(f"final test_acc={test_acc:.3f} test_loss={test_loss:.3f}")


if __name__ == "__main__":
    sys.exit(main())
