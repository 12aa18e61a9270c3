"""Notebook 04's four data-parallel training families, on one small problem.

Every family trains the same two-layer MLP (:func:`init_params`) on the same
synthetic data (:func:`make_data`); worker ``i`` of ``W`` draws its minibatches
from shard ``i`` (samples ``i, i + W, ...``) with a generator of its own seed.
The model is one flat float64 vector: a message, a shared tensor or an elastic
difference is a single tensor. Each family returns ``log``, rows of ``(seconds
since the start, updates applied, loss on the whole data set)`` of the variable
it trains (the replicated model, the server's copy, the shared vector, the
centre), and the staleness it measures. :func:`sync_sgd`, :func:`parameter_server`
and :func:`easgd` run on ranks started by ``tensorpar.spawn``; Hogwild, which
starts its own processes around one shared-memory tensor, is in ``nb_hogwild.py``.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

Data = tuple[torch.Tensor, torch.Tensor]  # inputs (samples, features), labels (samples,)
Row = tuple[float, int, float]            # (seconds, updates applied, loss)


@dataclass(frozen=True)
class Problem:
    """The model, the data and the optimiser every family shares."""

    samples: int = 1536
    features: int = 16
    hidden: int = 32
    classes: int = 2
    workers: int = 3     # processes computing gradients
    steps: int = 150     # gradients each worker computes
    batch: int = 16      # samples per gradient
    lr: float = 0.1
    seed: int = 0

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        """The shapes of W1, b1, W2, b2, in the order the flat vector holds them."""
        return [(self.hidden, self.features), (self.hidden,), (self.classes, self.hidden), (self.classes,)]

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


def make_data(p: Problem) -> Data:
    """Inputs from N(0, I); labels from a random tanh "teacher" network, with noise (so no model reaches loss 0)."""
    g = torch.Generator().manual_seed(p.seed)
    x = torch.randn(p.samples, p.features, generator=g, dtype=torch.float64)
    a = torch.randn(8, p.features, generator=g, dtype=torch.float64) / math.sqrt(p.features)
    b = torch.randn(8, generator=g, dtype=torch.float64)
    score = torch.tanh(2 * x @ a.T) @ b                                   # (samples,)
    y = (score + 0.3 * torch.randn(p.samples, generator=g, dtype=torch.float64) > 0).long()
    return x, y


def init_params(p: Problem) -> torch.Tensor:
    """The flat starting point, the same in every family: weights N(0, 1 / fan_in), biases 0."""
    g = torch.Generator().manual_seed(p.seed + 1)
    parts = [torch.randn(s, generator=g, dtype=torch.float64) / math.sqrt(s[1]) if len(s) == 2
             else torch.zeros(s, dtype=torch.float64) for s in p.shapes]
    return torch.cat([t.reshape(-1) for t in parts])


def loss_at(theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor, p: Problem) -> torch.Tensor:
    """Mean cross-entropy of the MLP ``tanh(x W1^T + b1) W2^T + b2`` whose parameters ``theta`` holds."""
    w1, b1, w2, b2 = (t.view(s) for t, s in zip(theta.split([math.prod(s) for s in p.shapes]), p.shapes, strict=True))
    return F.cross_entropy(torch.tanh(x @ w1.T + b1) @ w2.T + b2, y)   # (batch, hidden) -> (batch, classes)


def gradient(theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor, p: Problem) -> torch.Tensor:
    """d loss / d theta at ``theta`` (a new tensor)."""
    theta = theta.detach().requires_grad_()
    return torch.autograd.grad(loss_at(theta, x, y, p), theta)[0]


def full_loss(theta: torch.Tensor, data: Data, p: Problem) -> float:
    with torch.no_grad():
        return loss_at(theta, *data, p).item()


def minibatches(p: Problem, data: Data, worker: int) -> Iterator[Data]:
    """Endless minibatches of ``p.batch`` samples drawn with replacement from ``worker``'s shard."""
    x, y = data
    shard = torch.arange(worker, p.samples, p.workers)
    g = torch.Generator().manual_seed(1000 * (p.seed + 1) + worker)
    while True:
        pick = shard[torch.randint(len(shard), (p.batch,), generator=g)]
        yield x[pick], y[pick]


class Curve:
    """The rows of ``log``: a first one at ``theta``, then :meth:`add` after each update."""

    def __init__(self, p: Problem, data: Data, theta: torch.Tensor) -> None:
        self.p, self.data, self.start = p, data, time.perf_counter()
        self.rows: list[Row] = [(0.0, 0, full_loss(theta, data, p))]

    def add(self, updates: int, theta: torch.Tensor) -> None:
        self.rows.append((time.perf_counter() - self.start, updates, full_loss(theta, self.data, self.p)))


# --------------------------------------------------------------------------- 1: synchronous all-reduce SGD


def sync_sgd(p: Problem) -> dict:
    """Synchronous SGD on ``p.workers`` ranks, as DDP does it: each rank computes the gradient of its own
    minibatch at its replica, one all-reduce averages them, and every replica takes the same step.

    Staleness, measured rather than assumed: every gradient carries the version (updates applied) of
    the replica it was computed at; after the all-reduce the ranks gather these versions and
    subtract each from the version the step is applied to. Returns the staleness of every
    contribution, rank 0's curve, and the largest difference between the replicas at the end.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != p.workers:
        raise ValueError(f"sync_sgd needs one rank per worker: {world} ranks for {p.workers} workers")
    data, theta = make_data(p), init_params(p)
    batches = minibatches(p, data, rank)
    staleness: list[int] = []
    dist.barrier()
    curve = Curve(p, data, theta)
    for version in range(p.steps):                         # version: updates this replica has applied
        grad = gradient(theta, *next(batches), p)
        dist.all_reduce(grad)                              # the sum of the W gradients, on every rank
        versions = torch.zeros(world, dtype=torch.int64)
        versions[rank] = version                           # gathered by a sum: every rank's version, on every rank
        dist.all_reduce(versions)
        staleness += (version - versions).tolist()
        theta -= p.lr / world * grad
        if rank == 0:                                      # every replica is the same: one curve is enough
            curve.add(version + 1, theta)
    high, low = theta.clone(), theta.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return {"log": curve.rows, "staleness": staleness, "replica spread": (high - low).abs().max().item()}


# --------------------------------------------------------------------------- 2: parameter server


def serve(p: Problem, first: torch.Tensor, messages: int, handle: Callable[[int, torch.Tensor], torch.Tensor]) -> None:
    """On rank 0: serve the workers (ranks 1..W) on one thread each. Each is sent ``first``, then each
    of its ``messages`` messages is passed to ``handle(rank, message)``, one at a time under a lock, in
    arrival order, and what ``handle`` returns goes back to that worker alone.

    (One blocking receive per worker, each on its thread: gloo's receive from any source, ``dist.recv``
    without ``src``, mismatched messages here, and its receives cannot be polled.)
    """
    lock, errors = threading.Lock(), []

    def worker(rank: int) -> None:
        try:
            inbox = torch.empty(p.numel + 1, dtype=torch.float64)
            dist.send(first, rank)
            for _ in range(messages):
                dist.recv(inbox, rank)
                with lock:
                    reply = handle(rank, inbox)
                dist.send(reply, rank)
        except BaseException as e:  # noqa: BLE001 - re-raised below, on the calling thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(rank,), daemon=True) for rank in range(1, p.workers + 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def parameter_server(p: Problem) -> dict:
    """Rank 0 holds the parameters; ranks 1..W are asynchronous workers. A worker pushes the gradient
    of its minibatch, tagged with the version (server updates) of the parameters it computed it at; the
    server applies each gradient as it arrives, from whichever worker it comes, and answers that worker
    alone with the new parameters and their version: its next pull. No step waits for all workers.

    Staleness: server updates applied between a worker's pull and the update that applies its
    gradient. Returns, on rank 0, the curve, the staleness of every update and the worker that sent it.
    """
    data = make_data(p)
    if dist.get_rank() != 0:
        _ps_worker(p, data, dist.get_rank() - 1)
        return {}
    theta = init_params(p)
    curve, staleness, sender = Curve(p, data, theta), [], []

    def apply(rank: int, message: torch.Tensor) -> torch.Tensor:   # message: a gradient, then its version
        version = len(staleness)                                    # updates applied so far
        staleness.append(version - int(message[-1]))
        sender.append(rank)
        theta.sub_(p.lr * message[:-1])
        curve.add(version + 1, theta)
        return torch.cat([theta, torch.tensor([version + 1.0], dtype=theta.dtype)])

    serve(p, torch.cat([theta, torch.zeros(1, dtype=theta.dtype)]), p.steps, apply)   # first pull: version 0
    return {"log": curve.rows, "staleness": staleness, "sender": sender}


def _ps_worker(p: Problem, data: Data, worker: int) -> None:
    batches = minibatches(p, data, worker)
    pulled = torch.empty(p.numel + 1, dtype=torch.float64)  # parameters, then their version
    dist.recv(pulled, 0)
    for _ in range(p.steps):
        grad = gradient(pulled[:-1], *next(batches), p)
        dist.send(torch.cat([grad, pulled[-1:]]), 0)        # push, tagged with the version it was computed at
        dist.recv(pulled, 0)                                # pull: the server answers once it has applied it


# --------------------------------------------------------------------------- 4: elastic averaging SGD


def easgd(p: Problem, alpha: float, tau: int) -> dict:
    """Asynchronous elastic averaging SGD (Zhang, Choromanska and LeCun, 2015). Rank 0 holds the centre
    variable; ranks 1..W each start at it, train their own parameters with plain SGD and, every ``tau``
    local steps, exchange with it: ``d = alpha * (x_i - centre)``, ``x_i -= d``, ``centre += d``.

    Measured at each exchange (an update of the centre): the worker's local steps since its last
    exchange, its distance to the centre, and the centre updates made by other workers since its
    last exchange. Returns these on rank 0 with the centre's curve.
    """
    if p.steps % tau:
        raise ValueError(f"steps ({p.steps}) must be a multiple of tau ({tau}): every worker ends on an exchange")
    data = make_data(p)
    if dist.get_rank() != 0:
        _easgd_worker(p, data, dist.get_rank() - 1, alpha, tau)
        return {}
    centre = init_params(p)
    curve, local_steps, distance, behind = Curve(p, data, centre), [], [], []
    last_seen = [0] * (p.workers + 1)                        # the centre's version at each worker's last exchange

    def exchange(rank: int, message: torch.Tensor) -> torch.Tensor:   # message: x_i, then its local steps
        version = len(distance)                              # centre updates so far
        x = message[:-1]
        local_steps.append(int(message[-1]))
        distance.append((x - centre).norm().item())
        behind.append(version - last_seen[rank])
        before = centre.clone()                              # the worker computes the same d from it
        centre.add_(alpha * (x - centre))
        last_seen[rank] = version + 1
        curve.add(version + 1, centre)
        return before

    serve(p, centre.clone(), p.steps // tau, exchange)
    return {"log": curve.rows, "local steps": local_steps, "distance": distance, "centre behind": behind}


def _easgd_worker(p: Problem, data: Data, worker: int, alpha: float, tau: int) -> None:
    batches = minibatches(p, data, worker)
    x = torch.empty(p.numel, dtype=torch.float64)
    dist.recv(x, 0)                                          # every worker starts at the centre
    centre = torch.empty_like(x)
    since = 0                                                # local steps since the last exchange
    for step in range(1, p.steps + 1):
        x -= p.lr * gradient(x, *next(batches), p)
        since += 1
        if step % tau == 0:
            dist.send(torch.cat([x, torch.tensor([float(since)], dtype=x.dtype)]), 0)
            dist.recv(centre, 0)
            x -= alpha * (x - centre)                        # the elastic pull, mirror of the centre's move
            since = 0
