"""The bundled data set: 2,048 points of two interleaved half-moons (examples/data/two_moons.csv)."""

import os

import numpy as np

CSV = os.path.join(os.path.dirname(__file__), "data", "two_moons.csv")


def two_moons() -> tuple[np.ndarray, np.ndarray]:
    """Features (float32, shape [2048, 2]) and labels (float32 0/1, shape [2048, 1])."""
    table = np.loadtxt(CSV, delimiter=",", skiprows=1, dtype=np.float32)
    return table[:, :2], table[:, 2:]
