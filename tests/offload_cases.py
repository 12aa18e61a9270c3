"""Shared by the offloading tests: parameter groups, and a training loop with a new learning rate at
every step."""


LRS = (3e-2, 1e-2, 2e-2, 5e-3, 1.5e-2)  # a new learning rate at every step
ADAMW = dict(betas=(0.9, 0.95))


def groups(params):
    """Weight decay on matrices, none on vectors (as examples/train_gpt.py groups them)."""
    params = list(params)
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def train(model, optimizer, steps, loss_fn, first=0):
    """Steps ``first`` .. ``first + steps - 1``, each at its own learning rate; the losses."""
    losses = []
    for step in range(first, first + steps):
        for group in optimizer.param_groups:
            group["lr"] = LRS[step % len(LRS)]
        loss = loss_fn(model, step)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses

