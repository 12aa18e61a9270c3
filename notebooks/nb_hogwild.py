"""Notebook 04's third family, Hogwild: processes updating one shared-memory tensor with no lock,
on the problem of :mod:`nb_families`."""

from __future__ import annotations

import time

import torch
import torch.multiprocessing

from nb_families import Problem, full_loss, gradient, init_params, make_data, minibatches


def hogwild(p: Problem, timeout: float = 120.0) -> dict:
    """``p.workers`` processes update one shared-memory parameter vector with no lock (Niu et al., 2011).

    Each worker reads the vector (a copy, taken while others may be writing it), computes a gradient
    there, and subtracts ``lr * gradient`` in place. A shared counter holds one slot per worker, which
    only that worker increments after each write, so no count is lost; staleness is the number of
    other workers' writes counted between a worker's read and its write. Returns the curve (one
    row per write, from every worker, by time), the staleness of every write and the counter.
    Processes still running after ``timeout`` seconds are killed and reported.
    """
    ctx = torch.multiprocessing.get_context("spawn")
    theta = init_params(p).share_memory_()
    counts = torch.zeros(p.workers, dtype=torch.int64).share_memory_()          # writes done, per worker
    staleness = torch.full((p.workers, p.steps), -1, dtype=torch.int64).share_memory_()
    log = torch.zeros(p.workers, p.steps, 3, dtype=torch.float64).share_memory_()  # (clock, updates, loss)
    begun = torch.zeros(p.workers, dtype=torch.float64).share_memory_()         # each worker's clock at the start
    start = ctx.Barrier(p.workers)
    first = (0.0, 0, full_loss(theta, make_data(p), p))
    procs = [ctx.Process(target=_hogwild_worker, args=(p, w, theta, counts, staleness, log, begun, start),
                         daemon=True) for w in range(p.workers)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    running = [w for w, proc in enumerate(procs) if proc.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join()
    if running:
        raise TimeoutError(f"hogwild workers {running} of {p.workers} still ran after {timeout} s; killed")
    failed = {w: proc.exitcode for w, proc in enumerate(procs) if proc.exitcode != 0}
    if failed:
        raise RuntimeError(f"hogwild workers exited with codes {failed} (worker: code)")
    t0 = begun.min().item()
    rows = sorted((t - t0, int(n), loss) for t, n, loss in log.reshape(-1, 3).tolist())
    return {"log": [first, *rows], "staleness": staleness.reshape(-1).tolist(), "writes": counts.tolist()}


def _hogwild_worker(p: Problem, worker: int, theta: torch.Tensor, counts: torch.Tensor, staleness: torch.Tensor,
                    log: torch.Tensor, begun: torch.Tensor, start) -> None:
    torch.set_num_threads(1)                                # the workers share the cores
    data = make_data(p)
    batches = minibatches(p, data, worker)
    start.wait(timeout=60)                                  # all at once: none finishes before another starts
    begun[worker] = time.perf_counter()                     # CLOCK_MONOTONIC: one clock for every process
    for step in range(p.steps):
        landed = counts.sum().item()                        # writes finished before the read
        read = theta.clone()                                # the read: no lock, a write may be half done
        grad = gradient(read, *next(batches), p)
        staleness[worker, step] = counts.sum().item() - landed   # others' writes since (own slot unchanged)
        theta.sub_(p.lr * grad)                             # the write: no lock
        counts[worker] += 1                                 # only this worker writes its slot
        log[worker, step] = torch.tensor([time.perf_counter(), counts.sum().item(), full_loss(theta, data, p)],
                                         dtype=torch.float64)
