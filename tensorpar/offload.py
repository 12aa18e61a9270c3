"""Optimizer state in host memory (ZeRO-Offload's optimizer half): parameters and gradients stay on the
device; a float32 master copy of each parameter and the optimizer's state live on the host.

Mixed-precision Adam holds 16 bytes per parameter element: the bf16 parameter and gradient (2 + 2), a
float32 master copy and two float32 moments (4 + 4 + 4). :class:`OffloadedOptimizer` keeps those 12 on
the host, where the wrapped optimizer (torch's AdamW by default) updates the masters, and each step
moves the gradients down and the parameters up in their own dtype: 2 + 2 bytes per element in bf16,
4 + 4 in float32 (whose device then holds 8 bytes per element instead of 16).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .full import is_dtensor

#: What ``params`` may be: tensors, ``(name, tensor)`` pairs (``model.named_parameters()``), or groups.
Params = Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | Iterable[dict[str, Any]]


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a parameter's master copy: float32, or float64 for a float64 parameter."""
    return torch.promote_types(dtype, torch.float32)


def _host(like: torch.Tensor, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.empty(like.shape, dtype=dtype, device="cpu", pin_memory=pin)


class OffloadedOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` (default: AdamW) run in host memory over float32 master copies of ``params``.

    A ``torch.optim.Optimizer``: its ``param_groups`` hold the device parameters
    and their hyper-parameters (set ``group["lr"]`` before any step, as with
    any optimizer; every key is handed to the wrapped optimizer at each step),
    ``zero_grad`` clears the device gradients, and ``state`` maps each device
    parameter to its state: the wrapped optimizer's fields (AdamW: ``step``,
    ``exp_avg``, ``exp_avg_sq``) and ``master``, all host tensors.
    ``state_dict()`` holds those host tensors; ``load_state_dict`` keeps them on
    the host (and takes a wrapped-class state dict without masters too: each
    master then starts from its parameter). ``tensorpar.checkpoint`` saves and
    reshards this state like any optimizer's (see :meth:`state_like`).

    ``step()``: copies each gradient to the host (as float32), runs the wrapped
    optimizer there, and copies each updated master back into its parameter,
    cast to the parameter's dtype. A parameter without a gradient is skipped.
    On a CUDA device the masters and the transfer buffers are pinned and the
    copies asynchronous: the copies up are queued on the current stream when
    ``step()`` returns (work queued after them on that stream sees the new
    values). The moments, never transferred, are ordinary host memory.

    A master copy is the truth once its parameter has state: change a
    parameter outside ``step()`` (load weights, say) before its first step, or
    with ``load_state_dict``. Under ``ZeroRedundancyOptimizer(params,
    optimizer_class=OffloadedOptimizer, ...)`` each dp rank keeps on its host
    the state of the parameters it owns. ``DTensor`` parameters (FSDP2's) are
    refused: FSDP2 offloads with its own ``CPUOffloadPolicy``.

    Example::

        optimizer = tensorpar.OffloadedOptimizer(model.parameters(), torch.optim.AdamW, lr=3e-4,
                                                 betas=(0.9, 0.95), weight_decay=0.1)
        for group in optimizer.param_groups:
            group["lr"] = lr                    # per step, as with torch.optim.AdamW
        loss.backward()
        optimizer.step()                        # gradients down, AdamW on the host, parameters up
        optimizer.zero_grad()
        optimizer.host_bytes()                  # masters + state: 12 bytes per element for AdamW
        optimizer.bytes_moved_per_step()        # 2 x parameter bytes
    """

    def __init__(self, params: Params, optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
                 **defaults: Any) -> None:
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}")
        if issubclass(optimizer_class, OffloadedOptimizer):
            raise TypeError("optimizer_class is an OffloadedOptimizer, whose state is in host memory already")
        self.optimizer_class = optimizer_class
        self._inner: torch.optim.Optimizer | None = None  # built with the first group
        self._masters: dict[torch.Tensor, torch.Tensor] = {}  # device parameter -> its master copy
        self._buffers: dict[torch.Tensor, tuple[torch.Tensor | None, torch.Tensor]] = {}  # -> (staging, grad)
        super().__init__(params, defaults)

    def _checked(self, items: list[Any]) -> list[torch.Tensor]:
        """The tensors of a group's ``params`` (tensors or named tensors), each checked for offloading."""
        tensors = [item[1] if isinstance(item, tuple) else item for item in items]
        index = len(self.param_groups)
        labels = [item[0] if isinstance(item, tuple) else f"param_groups[{index}]['params'][{j}]"
                  for j, item in enumerate(items)]
        seen = set(self._masters)
        for p, label in zip(tensors, labels, strict=True):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"{label} is a {type(p).__name__}, not a tensor")
            if is_dtensor(p):
                raise TypeError(f"{label} is a DTensor (FSDP2's, say): OffloadedOptimizer takes plain tensors; "
                                "FSDP2 offloads its own with fully_shard(..., offload_policy=CPUOffloadPolicy())")
            if not p.is_floating_point():
                raise TypeError(f"{label} has dtype {p.dtype}: only floating-point parameters have master copies")
            if p.is_meta:
                raise ValueError(f"{label} is on the meta device: materialise the model before building "
                                 "its optimizer (the master copies are taken from the parameters)")
            if p in seen:
                raise ValueError(f"{label} is already in a parameter group of this optimizer")
            seen.add(p)
        return tensors

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of device parameters (with their hyper-parameters): their master copies join the
        wrapped optimizer, and the group gets every hyper-parameter the wrapped optimizer uses."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        params = param_group["params"]
        if isinstance(params, set):
            raise TypeError("a parameter group's params must be ordered (a list, not a set)")
        param_group = param_group | {"params": [params] if isinstance(params, torch.Tensor) else list(params)}
        tensors = self._checked(param_group["params"])
        masters = [_host(p, master_dtype(p.dtype), p.is_cuda).copy_(p.detach()) for p in tensors]
        twin = {k: v for k, v in param_group.items() if k not in ("params", "param_names")} | {"params": masters}
        if self._inner is None:
            self._inner = self.optimizer_class([twin], **self.defaults)
            self.defaults = dict(self._inner.defaults)
        else:
            self._inner.add_param_group(twin)
        self._masters.update(zip(tensors, masters, strict=True))
        hyper = {k: v for k, v in self._inner.param_groups[-1].items() if k != "params"}
        super().add_param_group(hyper | {k: v for k, v in param_group.items() if k in ("params", "param_names")})
        self._link(tensors)

    def _link(self, params: Iterable[torch.Tensor]) -> None:
        """Expose the wrapped optimizer's state of each parameter that has some, with its master."""
        inner = self._wrapped()
        for p in params:
            master = self._masters[p]
            fields = inner.state.get(master)
            if fields:
                fields["master"] = master
                self.state[p] = fields

    def _wrapped(self) -> torch.optim.Optimizer:
        assert self._inner is not None, "OffloadedOptimizer without a parameter group"
        return self._inner

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def master(self, param: torch.Tensor) -> torch.Tensor:
        """The master copy of ``param`` (one of this optimizer's device parameters), in host memory."""
        if param not in self._masters:
            raise ValueError(f"a tensor of shape {tuple(param.shape)} is not a parameter of this optimizer")
        self._settle([param])
        return self._masters[param]

    #: The checkpoint's question, where and in what dtype this optimizer keeps state shaped like a
    #: parameter: with its master copy (the host, float32).
    state_like = master

    @staticmethod
    def _wait(params: Iterable[torch.Tensor]) -> None:
        """Wait for the copies queued on each CUDA device of ``params``."""
        for device in {p.device for p in params if p.is_cuda}:
            torch.cuda.current_stream(device).synchronize()

    def _buffer(self, p: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``(staging, grad)`` of ``p``: the host gradient of its master, and on CUDA, for a parameter in
        another dtype than its master, a pinned buffer in the parameter's dtype that the transfers use."""
        if p not in self._buffers:
            master = self._masters[p]
            staging = _host(p, p.dtype, True) if p.is_cuda and p.dtype != master.dtype else None
            self._buffers[p] = staging, _host(p, master.dtype, p.is_cuda and staging is None)
        return self._buffers[p]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter that has a gradient; returns ``closure()`` when given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        inner = self._wrapped()
        for group, twin in zip(self.param_groups, inner.param_groups, strict=True):
            twin.update({k: v for k, v in group.items() if k not in ("params", "param_names")})
        grads = {p: p.grad for p in self._params() if p.grad is not None}
        live = list(grads)
        for p, grad in grads.items():
            if grad.layout != torch.strided:
                raise TypeError(f"a parameter of shape {tuple(p.shape)} has a {grad.layout} gradient: "
                                "OffloadedOptimizer moves dense gradients only")
        self._settle(live)
        for p in live:  # down: each gradient in its own dtype
            staging, grad = self._buffer(p)
            if not self.state.get(p):  # its first step: the master starts from the parameter as it is now
                self._masters[p].copy_(p, non_blocking=True)
            (grad if staging is None else staging).copy_(grads[p], non_blocking=True)
        self._wait(live)
        for p in live:
            staging, grad = self._buffers[p]
            if staging is not None:
                grad.copy_(staging)  # to float32, on the host
            self._masters[p].grad = grad
        inner.step()
        for p in live:  # up: each parameter in its own dtype
            master, (staging, _) = self._masters[p], self._buffers[p]
            master.grad = None
            p.copy_(master if staging is None else staging.copy_(master), non_blocking=True)
        self._link(live)
        return loss

    def _check_masters(self, state_dict: Mapping[str, Any]) -> None:
        """Raise before anything changes unless the saved groups match ours and each saved master has
        its parameter's shape."""
        saved = state_dict["param_groups"]
        ours = [len(g["params"]) for g in self.param_groups]
        theirs = [len(g["params"]) for g in saved]
        if ours != theirs:
            raise ValueError(f"the state dict's groups hold {theirs} parameters, this optimizer's {ours}")
        params = dict(zip((i for g in saved for i in g["params"]), self._params(), strict=True))
        for key, fields in state_dict["state"].items():
            master = fields.get("master") if key in params else None
            if master is not None and tuple(master.shape) != tuple(params[key].shape):
                raise ValueError(f"the state dict's master of parameter {key} has shape {tuple(master.shape)}, "
                                 f"the parameter {tuple(params[key].shape)}")

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load ``state_dict`` (from :meth:`state_dict`, or from the wrapped class without masters), keeping
        every state tensor in host memory (torch's ``load_state_dict`` would move it to the device)."""
        state_dict = dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            changed = pre_hook(self, state_dict)
            state_dict = state_dict if changed is None else changed
        self._check_masters(state_dict)
        params = self._params()
        self._wait(params)  # no copy up may still be reading a master this overwrites
        inner = self._wrapped()
        inner.load_state_dict(state_dict)  # torch's checks, and each tensor cast to its master's device and dtype
        self.state = defaultdict(dict)
        for p in params:
            fields = inner.state.get(self._masters[p])
            if fields:
                self._adopt(p, fields)
            else:
                self._masters[p].copy_(p.detach())
        for group, twin in zip(self.param_groups, inner.param_groups, strict=True):
            group.update({k: v for k, v in twin.items() if k != "params"})
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _settle(self, params: Iterable[torch.Tensor]) -> None:
        """Take in state set into ``self.state`` from outside (``ZeroRedundancyOptimizer.load_state_dict``)."""
        for p in params:
            fields = self.state.get(p)
            if fields and self._wrapped().state.get(self._masters[p]) is not fields:
                self._adopt(p, fields)

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict: the state of each parameter (host tensors, its master among them)."""
        self._settle(self._params())
        return super().state_dict()

    def _adopt(self, p: torch.Tensor, fields: dict[str, Any]) -> None:
        """Make ``fields`` the state of ``p``: its tensors copied into host memory (floats but ``step`` in the
        master's dtype), its master copy from ``fields["master"]`` when there is one, else from ``p``."""
        master = self._masters[p]
        for field, value in fields.items():  # copies, so no two optimizers share a tensor
            if isinstance(value, torch.Tensor) and field != "master":
                dtype = master.dtype if value.is_floating_point() and field != "step" else value.dtype
                fields[field] = value.detach().to("cpu", dtype, copy=True)
        master.copy_(fields.get("master", p).detach())
        fields["master"] = master
        self._wrapped().state[master] = self.state[p] = fields

    def host_bytes(self, *, buffers: bool = False) -> int:
        """Bytes of host memory this optimizer holds: every master copy and every state tensor (AdamW:
        12 per element of a float32 master), and with ``buffers`` the gradient and staging buffers of
        the parameters that have had a step (4 per element, + the parameter's size where it has a
        staging buffer)."""
        self._settle(self._params())
        tensors = list(self._masters.values())
        tensors += [v for fields in self._wrapped().state.values() for v in fields.values()
                    if isinstance(v, torch.Tensor)]
        if buffers:
            tensors += [b for pair in self._buffers.values() for b in pair if b is not None]
        unique = {id(t): t for t in tensors}  # each master is also in its state
        return sum(t.numel() * t.element_size() for t in unique.values())

    def bytes_moved_per_step(self) -> int:
        """Bytes a step moves between device and host when every parameter that requires a gradient has
        one in its own dtype: each gradient down plus each parameter up, i.e. twice the parameters' bytes
        (the first step also copies each master down once, which this does not count)."""
        return sum(2 * p.numel() * p.element_size() for p in self._params() if p.requires_grad)
