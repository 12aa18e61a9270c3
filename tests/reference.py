"""Plain unsharded reference modules, written with torch.nn only."""

from torch import nn


class DenseMLP(nn.Module):
    """The dense twin of column -> GELU -> row: Linear(d, h) -> GELU -> Linear(h, d)."""

    def __init__(self, d: int, hidden: int, bias: bool = True, dtype=None):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden, bias=bias, dtype=dtype)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, d, bias=bias, dtype=dtype)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))
