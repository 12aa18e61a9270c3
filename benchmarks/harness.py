"""Examples per second through a persistent tensorpar.testing pool.

    python benchmarks/harness.py [--world 2] [--examples 200]

Each example is one small column-parallel linear check (build from nn.Linear,
forward, backward, gather gradients, compare), sent to every rank of an
already started pool, as a hypothesis test does.
"""

import argparse
import time

from checks import check_column
from results import machine, write_section
from tensorpar.testing import World


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--write", action="store_true", help="record the figure in benchmarks/RESULTS.md")
    args = parser.parse_args()
    world = World(args.world)
    try:
        world.run(check_column, 8, 12, 0)  # start-up, not timed
        start = time.perf_counter()
        for seed in range(args.examples):
            world.run(check_column, 8, 12, seed)
        elapsed = time.perf_counter() - start
    finally:
        world.close()
    line = (f"world size {args.world}: {args.examples / elapsed:.0f} examples/s "
            f"({elapsed / args.examples * 1e3:.1f} ms per example; target ≥ 50/s at world size 2)")
    print(line)
    if args.write:
        write_section(f"Test harness throughput, world size {args.world}",
                      f"{machine()}; {args.examples} small column-parallel linear checks through a started pool "
                      f"(`python benchmarks/harness.py --world {args.world} --write`).\n\n{line}")


if __name__ == "__main__":
    main()
