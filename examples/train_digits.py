"""Example gpufleet workload: a 1-hidden-layer MLP on scikit-learn's bundled digits data.

Plain numpy (it never touches a GPU, it only reports which ones it was given), so it runs
anywhere and shows the job contract the agent relies on; see examples/README.md:

* env in: ``GPUFLEET_CHECKPOINT_DIR``, ``GPUFLEET_ARTIFACTS_DIR``, ``GPUFLEET_RESUME_FROM``
  (a local directory holding an earlier attempt's ``ckpt.npz``, or unset/empty),
  ``GPUFLEET_JOB_ID``, ``GPUFLEET_RUN_ID``, ``CUDA_VISIBLE_DEVICES``;
* checkpoint handshake: on SIGTERM it writes its checkpoint, then creates the file named by
  ``GPUFLEET_CHECKPOINT_DONE`` (when set): the agent stops the attempt at once instead of
  waiting out the grace period (``--teardown-s`` simulates a slow shutdown after the
  checkpoint, ``--no-checkpoint-signal`` leaves the file out);
* exit codes: 0 done (artifacts written); 143 (= 128 + SIGTERM) stopped by SIGTERM *after*
  writing a checkpoint, so the attempt can be resumed; ``--fail-exit-code`` (default 3) for the
  injected failure of ``--fail-at-step``; anything else is an ordinary failure.

Deterministic given ``--seed``: the checkpoint holds the weights, the step and the state of the
one random generator, so stop-and-resume reproduces the uninterrupted run exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

Params = dict[str, np.ndarray]  # w1 (64, hidden), b1 (hidden,), w2 (hidden, 10), b2 (10,)

CKPT_NAME = "ckpt.npz"
EXIT_SIGTERM = 143  # shell convention 128 + SIGTERM(15): "stopped on request, checkpoint saved"

_stop_requested = False


def _on_sigterm(signum: int, frame: object) -> None:  # noqa: ARG001 (signal handler signature)
    # Only set a flag: the loop finishes the current step, checkpoints, then exits 143.
    global _stop_requested
    _stop_requested = True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="total SGD steps (default 300)")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    p.add_argument("--lr", type=float, default=0.2, help="SGD learning rate")
    p.add_argument("--hidden", type=int, default=64, help="hidden units")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.01, help="seconds slept per step")
    p.add_argument("--fail-at-step", type=int, default=None, help="exit non-zero at this step")
    p.add_argument("--fail-exit-code", type=int, default=3)
    p.add_argument(
        "--teardown-s",
        type=float,
        default=0.0,
        help="seconds of (simulated) shutdown after the SIGTERM checkpoint, before exiting",
    )
    p.add_argument(
        "--no-checkpoint-signal",
        action="store_true",
        help="do not create $GPUFLEET_CHECKPOINT_DONE after the SIGTERM checkpoint",
    )
    return p.parse_args(argv)


def signal_checkpoint_done() -> None:
    """Tell the agent the checkpoint is durable (the handshake): create the file it names in
    ``GPUFLEET_CHECKPOINT_DONE``. Call only after the checkpoint's final rename."""
    path = os.environ.get("GPUFLEET_CHECKPOINT_DONE")
    if path:
        Path(path).touch()


def load_data(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test): 8x8 images flattened to 64 floats in [0, 1]."""
    # Imported here (slow import) so the SIGTERM handler is installed before it.
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x / 16.0, y, test_size=0.2, random_state=seed, stratify=y
    )
    return x_tr, y_tr, x_te, y_te


def init_params(rng: np.random.Generator, n_in: int, hidden: int, n_out: int) -> Params:
    return {  # He initialisation for the ReLU layer.
        "w1": rng.normal(0.0, np.sqrt(2.0 / n_in), (n_in, hidden)),
        "b1": np.zeros(hidden),
        "w2": rng.normal(0.0, np.sqrt(1.0 / hidden), (hidden, n_out)),
        "b2": np.zeros(n_out),
    }


def forward(params: Params, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Returns (hidden activations (n, hidden), class probabilities (n, 10))."""
    h = np.maximum(0.0, x @ params["w1"] + params["b1"])
    logits = h @ params["w2"] + params["b2"]
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    return h, p / p.sum(axis=1, keepdims=True)


def evaluate(params: Params, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(mean cross-entropy loss, accuracy)."""
    _, p = forward(params, x)
    loss = -np.log(p[np.arange(len(y)), y] + 1e-12).mean()
    return float(loss), float((p.argmax(axis=1) == y).mean())


def sgd_step(params: Params, x: np.ndarray, y: np.ndarray, lr: float) -> None:
    h, p = forward(params, x)
    d_logits = p.copy()
    d_logits[np.arange(len(y)), y] -= 1.0
    d_logits /= len(y)
    d_h = (d_logits @ params["w2"].T) * (h > 0)
    params["w2"] -= lr * (h.T @ d_logits)
    params["b2"] -= lr * d_logits.sum(axis=0)
    params["w1"] -= lr * (x.T @ d_h)
    params["b1"] -= lr * d_h.sum(axis=0)


def atomic_savez(path: Path, **arrays: Any) -> None:
    """Write ``path`` so a reader sees the old file or the new one, never a torn one."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(ckpt_dir: Path, params: Params, step: int, rng: np.random.Generator) -> None:
    rng_state = json.dumps(rng.bit_generator.state)
    atomic_savez(
        ckpt_dir / CKPT_NAME, step=np.array(step), rng_state=np.array(rng_state), **params
    )


def load_checkpoint(resume_dir: str, params: Params, rng: np.random.Generator) -> int | None:
    """Load ``resume_dir/ckpt.npz`` into params and rng in place; the step, or None if absent."""
    path = Path(resume_dir) / CKPT_NAME
    if not resume_dir or not path.is_file():
        return None
    with np.load(path) as ckpt:
        for name in params:
            if ckpt[name].shape != params[name].shape:
                sys.exit(
                    f"checkpoint {path}: {name} has shape {ckpt[name].shape}, "
                    f"expected {params[name].shape} (different --hidden?)"
                )
            params[name] = ckpt[name].copy()
        rng.bit_generator.state = json.loads(str(ckpt["rng_state"]))
        return int(ckpt["step"])


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _on_sigterm)
    args = parse_args(argv)
    started = time.monotonic()
    ckpt_dir = Path(os.environ.get("GPUFLEET_CHECKPOINT_DIR") or "checkpoints")
    art_dir = Path(os.environ.get("GPUFLEET_ARTIFACTS_DIR") or "artifacts")
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    art_dir.mkdir(parents=True, exist_ok=True)
    job_id, run_id = os.environ.get("GPUFLEET_JOB_ID", ""), os.environ.get("GPUFLEET_RUN_ID", "")
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
    print(
        f"job {job_id or '-'} run {run_id or '-'}: training on "
        + (f"GPUs {gpus}" if gpus else "CPU (CUDA_VISIBLE_DEVICES unset)"),
        flush=True,
    )

    x_tr, y_tr, x_te, y_te = load_data(args.seed)
    rng = np.random.default_rng(args.seed)
    params = init_params(rng, x_tr.shape[1], args.hidden, 10)
    start_step = load_checkpoint(os.environ.get("GPUFLEET_RESUME_FROM", ""), params, rng)
    if start_step is not None:
        print(f"resumed from step {start_step}", flush=True)
    report_every = max(1, args.steps // 10)

    step = start_step or 0
    while step < args.steps:
        if _stop_requested:
            save_checkpoint(ckpt_dir, params, step, rng)
            if not args.no_checkpoint_signal:
                signal_checkpoint_done()
            print(f"SIGTERM: checkpointed step {step}, exiting {EXIT_SIGTERM}", flush=True)
            time.sleep(args.teardown_s)  # e.g. data loaders and process groups shutting down
            return EXIT_SIGTERM
        batch = rng.integers(0, len(y_tr), args.batch_size)
        sgd_step(params, x_tr[batch], y_tr[batch], args.lr)
        step += 1
        if step % args.checkpoint_every == 0:
            save_checkpoint(ckpt_dir, params, step, rng)
        if step % report_every == 0 or step == args.steps:
            loss, acc = evaluate(params, x_tr, y_tr)
            print(f"step {step}/{args.steps} loss={loss:.3f} train_acc={acc:.3f}", flush=True)
        # Fires after this step's checkpoint: an attempt resumed at or past it does not fail again.
        if step == args.fail_at_step:
            print(f"injected failure at step {step}", file=sys.stderr, flush=True)
            return int(args.fail_exit_code)
        time.sleep(args.step_sleep)

    save_checkpoint(ckpt_dir, params, step, rng)
    test_loss, test_acc = evaluate(params, x_te, y_te)
    train_loss, train_acc = evaluate(params, x_tr, y_tr)
    atomic_savez(art_dir / "model.npz", **params)
    metrics = {
        "test_acc": test_acc,
        "test_loss": test_loss,
        "train_acc": train_acc,
        "train_loss": train_loss,
        "steps": step,
        "resumed_from_step": start_step,
        "wall_s": round(time.monotonic() - started, 3),
        "seed": args.seed,
        "job_id": job_id or None,
        "run_id": run_id or None,
    }
    tmp = art_dir / ".metrics.json.tmp"
    tmp.write_text(json.dumps(metrics, indent=2) + "\n")
    os.replace(tmp, art_dir / "metrics.json")
    print(f"final test_acc={test_acc:.3f} test_loss={test_loss:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
