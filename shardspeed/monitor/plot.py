"""Plot the CSV monitor's loss and learning-rate curves to a PNG (`pip install 'shardspeed[plot]'`).

python -m shardspeed.monitor.plot <output_path>/<job_name> --out curves.png
"""

from __future__ import annotations

import argparse
import csv
import os

from shardspeed.monitor.base import missing_extra
from shardspeed.monitor.csv_monitor import csv_path

__all__ = ["main", "plot_training_curves", "read_series"]

PANELS = (("Train/Samples/train_loss", "loss"), ("Train/Samples/lr", "learning rate"))


def read_series(log_dir: str, name: str) -> tuple[list[int], list[float]]:
    """The (samples, values) of one event written by the CSV monitor."""
    path = csv_path(log_dir, name)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path} not found: is csv_monitor enabled and is {log_dir} its output_path/job_name?"
        )
    with open(path, newline="") as f:
        rows = list(csv.reader(f))[1:]
    return [int(r[0]) for r in rows], [float(r[1]) for r in rows]


def plot_training_curves(log_dir: str, out: str) -> str:
    """Write a PNG with the loss and the learning rate against samples seen; returns its path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise missing_extra("plotting the csv_monitor", "matplotlib", "plot") from err
    fig, axes = plt.subplots(1, len(PANELS), figsize=(10, 3.5))
    for ax, (name, label) in zip(axes, PANELS):
        x, y = read_series(log_dir, name)
        ax.plot(x, y)
        ax.set_xlabel("samples")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle(os.path.basename(os.path.normpath(log_dir)))
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Plot csv_monitor loss and learning rate to a PNG")
    parser.add_argument("log_dir", help="the csv_monitor's output_path/job_name directory")
    parser.add_argument("--out", default="training_curves.png")
    args = parser.parse_args(argv)
    print(plot_training_curves(args.log_dir, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
