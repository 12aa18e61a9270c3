"""A training run's speed: tokens per second over the last steps, and the model FLOPs utilisation
(MFU) that makes of the devices' peak, from wall-clock step times (no device sync of its own)."""

from __future__ import annotations

from collections import deque
from typing import Any


class Throughput:
    """Tokens/s and MFU over a sliding window of the last ``window`` steps: the tokens of those
    steps over their summed wall-clock seconds, so one slow step (the first, which compiles and
    warms up; one that also validated) weighs as little as its share of the time.

    ``flops_per_token``: the model's FLOPs for one token, forward and backward
    (:func:`~tensorpar.training.hardware.model_flops_per_token`); ``peak_tflops``: one device's
    dense peak, or ``None`` when unknown (then no MFU); ``devices``: how many devices share the work.

    Example::

        meter = Throughput(tokens_per_step=16 * 1024, flops_per_token=8.6e8, peak_tflops=989.0, devices=1)
        figures = meter.step(0.27)    # {"tokens_per_s": 60681.5, "mfu": 0.0528}
    """

    def __init__(self, *, tokens_per_step: int, flops_per_token: float, peak_tflops: float | None, devices: int,
                 window: int = 20) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1 step, got {window}")
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.peak_tflops, self.devices = peak_tflops, devices
        self.peak_flops = None if peak_tflops is None else peak_tflops * 1e12 * devices  # all devices together
        self.seconds: deque[float] = deque(maxlen=window)
        self.figures: dict[str, float] = {}

    def step(self, seconds: float) -> dict[str, float]:
        """Count a step of ``seconds``; the window's ``tokens_per_s`` and, with a known peak, ``mfu``
        (a fraction of the peak)."""
        self.seconds.append(seconds)
        tokens_per_s = self.tokens_per_step * len(self.seconds) / sum(self.seconds)
        figures = {"tokens_per_s": tokens_per_s}
        if self.peak_flops is not None:
            figures["mfu"] = tokens_per_s * self.flops_per_token / self.peak_flops
        self.figures = figures
        return figures

    def summary(self) -> dict[str, Any]:
        """The last step's figures with the ``window`` they span, the ``devices`` and one's
        ``peak_tflops`` (None: unknown); no figures before the first step."""
        return dict(self.figures, window=len(self.seconds), devices=self.devices, peak_tflops=self.peak_tflops)


def hardware_summary(hardware: dict[str, Any]) -> str:
    """Two lines on a run's speed and memory: :meth:`Throughput.summary` with the ``device``, the
    ``dtype`` and every rank's ``peak_memory_bytes``."""
    mfu = (f"MFU {hardware['mfu']:.1%} of {hardware['devices']} x {hardware['peak_tflops']:g} TFLOP/s"
           if "mfu" in hardware else "MFU unknown (no known peak for this device: give --peak-tflops)")
    memory = ", ".join(f"{b / 2**30:.2f}" for b in hardware["peak_memory_bytes"])
    kind = "max allocated on the GPU" if hardware["device"].startswith("cuda") else "peak resident set"
    return (f"{hardware['device']}, {hardware['dtype']}: {hardware['tokens_per_s']:,.0f} tokens/s (last "
            f"{hardware['window']} steps), {mfu}\npeak memory per rank (GiB, {kind}): {memory}")
