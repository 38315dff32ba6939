"""Write wine.csv: a SYNTHETIC stand-in for the UCI wine data set (no download here).

Same shape as the real set: 178 rows, 13 features, 3 classes (59 / 71 / 48 rows),
labels one-hot in the last three columns. Each class is a Gaussian with roughly the
real set's per-class feature means and within-class spreads, drawn with a fixed seed,
so the file is byte-for-byte reproducible: `python benchmarks/data/make_wine.py`.
Only the shape matters to the benchmark (one full-batch training step).
"""
from pathlib import Path

import numpy as np

FEATURES = ["alcohol", "malic_acid", "ash", "alcalinity", "magnesium", "total_phenols",
            "flavanoids", "nonflavanoid_phenols", "proanthocyanins", "color_intensity",
            "hue", "od280_od315", "proline"]
MEANS = np.array([
    [13.74, 2.01, 2.46, 17.0, 106.3, 2.84, 2.98, 0.29, 1.90, 5.53, 1.06, 3.16, 1116.0],
    [12.28, 1.93, 2.24, 20.2, 94.5, 2.26, 2.08, 0.36, 1.63, 3.09, 1.06, 2.79, 520.0],
    [13.15, 3.33, 2.44, 21.4, 99.3, 1.68, 0.78, 0.45, 1.15, 7.40, 0.68, 1.68, 630.0]])
SPREADS = np.array([0.46, 0.8, 0.25, 2.8, 12.0, 0.35, 0.45, 0.09, 0.5, 1.5, 0.15, 0.4, 180.0])
COUNTS = (59, 71, 48)


def make(seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for c, n in enumerate(COUNTS):
        x = MEANS[c] + SPREADS * rng.standard_normal((n, len(FEATURES)))
        x = np.maximum(x, 0.01 * MEANS[c])            # keep every feature positive, as measured
        y = np.zeros((n, 3))
        y[:, c] = 1
        rows.append(np.hstack([x, y]))
    return np.vstack(rows)[rng.permutation(sum(COUNTS))]


if __name__ == "__main__":
    data = make()
    header = ",".join(FEATURES + ["class_0", "class_1", "class_2"])
    fmt = ["%.4g"] * len(FEATURES) + ["%d"] * 3
    np.savetxt(Path(__file__).with_name("wine.csv"), data, fmt=fmt, delimiter=",", header=header, comments="")
