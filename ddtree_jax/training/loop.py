"""The one training loop: the target and drafter stages and the CPU recipe run their steps through it.

``train_steps`` calls a compiled step (``ddtree_jax.compiled.CompiledFn`` whose body updates the
model and optimiser and returns the batch's loss) on ``batch_at(s)`` for steps ``s`` from
``info["step"]`` on. A step's batch is a function of ``s`` alone (``data.TokenWindows``,
``drafter.drafter_batch``), so a run resumed at step ``s`` sees the batches an uninterrupted run
would. Progress, the clock, evaluation and saving are the caller's hooks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np

from ddtree_jax.compiled import CompiledFn
from ddtree_jax.training.run import Clock

__all__ = ["train_steps"]


def train_steps(name: str, step: CompiledFn, batch_at: Callable[[int], tuple], info: dict, *, steps: int,
                limit: int | None = None, log: Callable[[str], None] = print, log_every: int = 50,
                clock: Clock | None = None, note: Callable[[int], str] | None = None,
                record: Callable[[dict], None] | None = None, evaluate: Callable[[], float] | None = None,
                eval_every: int = 1, eval_s: float = 10.0, save: Callable[[str], None] | None = None,
                save_every_s: float = math.inf) -> list[float]:
    """Runs steps ``info["step"] .. limit - 1`` (``limit`` at most ``steps``, the run's length, the
    default); returns the losses of the steps it ran.

    * ``info["step"]`` counts the steps done; it advances after each step (the hooks read it).
    * With ``clock``, it stops early, and says so, once the next step (and the evaluation due after
      it, ``eval_s`` seconds until one is timed) would pass the clock's limit.
    * A loss that is not finite ends the run (``SystemExit``).
    * It logs ``[name] step s/steps`` after the first step of the call, every ``log_every`` steps
      and after the last: the mean loss since the previous line, the time per step, ``note(s)``,
      the elapsed time; ``record`` receives the line as ``{step, train_loss, time}``.
    * ``evaluate()`` (returns the seconds it took) runs after every ``eval_every``-th step and
      after step ``steps``; ``save("periodic")`` once ``save_every_s`` seconds passed since the start
      or the last save.

    The modules stay stale until ``step.sync()`` (the hooks call it before they read them).
    """
    start = info["step"]
    limit = steps if limit is None else min(limit, steps)
    losses, since, step_s = [], 0, 0.0
    t0 = t_log = last_save = time.perf_counter()
    while info["step"] < limit:
        s = info["step"]
        evaluates_next = evaluate is not None and ((s + 1) % eval_every == 0 or s + 1 == steps)
        if clock is not None and clock.should_stop(step_s + (eval_s if evaluates_next else 0.0)):
            log(f"[{name}] stopping before the {clock.minutes:g}-minute limit at step {s} ({clock.elapsed():.0f}s); "
                "run the same command again to continue")
            break
        t = time.perf_counter()
        loss = float(step(*batch_at(s)))
        if s > start:  # the first step of a call compiles
            step_s = time.perf_counter() - t
        info["step"] = s = s + 1
        losses.append(loss)
        if not math.isfinite(loss):
            raise SystemExit(f"[{name}] loss is {loss} at step {s}: lower the learning rate (--lr)")
        if s == start + 1 or s % log_every == 0 or s == limit:
            window = losses[since:]
            elapsed = clock.elapsed() if clock is not None else time.perf_counter() - t0
            log(f"[{name}] step {s}/{steps} loss {np.mean(window):.4f} (mean of {len(window)}), "
                f"{(time.perf_counter() - t_log) / len(window) * 1e3:.0f} ms/step, "
                + (f"{note(s)}, " if note is not None else "") + f"{elapsed:.0f}s"
                + (" (step 1 compiles)" if s == start + 1 else ""))
            if record is not None:
                record(dict(step=s, train_loss=float(np.mean(window)), time=time.time()))
            since, t_log = len(losses), time.perf_counter()
        if evaluate is not None and (s % eval_every == 0 or s == steps):
            eval_s = evaluate()
        if save is not None and time.perf_counter() - last_save > save_every_s:
            save("periodic")
            last_save = time.perf_counter()
    return losses
