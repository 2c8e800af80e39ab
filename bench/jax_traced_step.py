"""One traced step of a Keras fit on the JAX backend: keras_prof's ProfilerHook against `jax.profiler` alone
(`start_trace` before the step, `stop_trace` after it, as a JAX user would; it writes the session's
`.xplane.pb` and `.trace.json.gz`), in the same process, on the same model.

Each fit runs STEPS steps (`HOOKPROF_BENCH_STEPS`, default 30) and traces the 10th. Two figures per kind:
- the traced step: its wall time (from the first callback's batch begin to the last one's batch end) less the
  median of the untraced steps before it in the same fit (after it, ProfilerHook's background work competes
  for the cores): what the training thread waits for;
- the fit: its wall time less a fit without profiling: everything, ProfilerHook's background conversion and
  files included (a fit returns only once they are on disk).
ProfilerHook runs with its defaults (timeline with dataflow arrows, TensorBoard graph and step_N run
metadata). The same compiled model is refit for every kind, so the steady state is measured: the first
trace after a compile also exports the programs' HLO (printed once, from the warm-up). MLPs of 4 and 32
`Dense(256)` layers; medians of ROUNDS fits of each kind, in rotating order.
"""

import logging
import os
import statistics
import tempfile
import time

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_prof import ProfilerHook  # noqa: E402

STEPS = int(os.environ.get("HOOKPROF_BENCH_STEPS", 30))
TRACED = min(10, STEPS)  # the traced step (1-based)
ROUNDS = 5
SIZES = (4, 32)  # Dense(256) layers
KINDS = ("none", "hookprof ProfilerHook", "jax.profiler")


class StepClock(keras.callbacks.Callback):
    """Batch begin/end times; the fit uses two, first and last in the callback list, to bracket the others."""

    def __init__(self):
        super().__init__()
        self.begin: list[float] = []
        self.end: list[float] = []

    def on_train_batch_begin(self, batch, logs=None):
        self.begin.append(time.perf_counter())

    def on_train_batch_end(self, batch, logs=None):
        self.end.append(time.perf_counter())


class JaxProfilerStep(keras.callbacks.Callback):
    """`jax.profiler` alone around one step (its global step `step`, 1-based)."""

    def __init__(self, step: int, log_dir: str):
        super().__init__()
        self.step, self.log_dir, self.seen = step, log_dir, 0

    def on_train_batch_begin(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.step:
            jax.profiler.start_trace(self.log_dir)

    def on_train_batch_end(self, batch, logs=None):
        if self.seen == self.step:
            jax.profiler.stop_trace()


def mlp(layers: int) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((256,))] + [keras.layers.Dense(256, activation="relu", name=f"fc{i}")
                                                       for i in range(layers)] + [keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    return model


def fit(model: keras.Model, kind: str) -> tuple[float, float]:
    """(fit seconds, traced step seconds less the median untraced step)."""
    out = tempfile.mkdtemp()
    x = np.random.default_rng(0).standard_normal((STEPS * 64, 256)).astype("float32")
    y = x[:, :1]
    first, last = StepClock(), StepClock()
    middle = []
    if kind == "hookprof ProfilerHook":
        middle = [ProfilerHook(save_steps=TRACED, output_dir=out)]  # the first timeline comes at step TRACED
    elif kind == "jax.profiler":
        middle = [JaxProfilerStep(TRACED, out)]
    start = time.perf_counter()
    model.fit(x, y, batch_size=64, epochs=1, callbacks=[first, *middle, last], verbose=0)
    total = time.perf_counter() - start
    steps = [end - begin for begin, end in zip(first.begin, last.end)]
    traced = steps[TRACED - 1]
    before = steps[2:TRACED - 1] or steps[:TRACED - 1]  # the first steps warm the data pipeline up
    return total, traced - statistics.median(before)


def main():
    logging.getLogger("hookprof").setLevel(logging.WARNING)
    print(f"jax {jax.__version__}, keras {keras.__version__}, {jax.devices()[0].platform}; {STEPS} steps a fit, "
          f"the traced step is step {TRACED}; medians of {ROUNDS} fits")
    print("| model | traced step: ProfilerHook | traced step: jax.profiler | ratio | fit: ProfilerHook | "
          "fit: jax.profiler | ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for layers in SIZES:
        model = mlp(layers)
        fit(model, "none")  # compiles
        _, first_trace = fit(model, "hookprof ProfilerHook")  # the first trace after the compile exports HLO
        fit(model, "jax.profiler")
        totals = {kind: [] for kind in KINDS}
        steps = {kind: [] for kind in KINDS}
        for round_ in range(ROUNDS):
            for kind in KINDS[round_ % 3:] + KINDS[: round_ % 3]:
                total, step = fit(model, kind)
                totals[kind].append(total)
                steps[kind].append(step)
        base = statistics.median(totals["none"])
        ours_step, theirs_step = (statistics.median(steps[k]) for k in KINDS[1:])
        ours_fit, theirs_fit = (statistics.median(totals[k]) - base for k in KINDS[1:])
        print(f"| {layers} x Dense(256) | {ours_step * 1e3:.1f} ms | {theirs_step * 1e3:.1f} ms | "
              f"{ours_step / theirs_step:.2f}x | {ours_fit * 1e3:.1f} ms | {theirs_fit * 1e3:.1f} ms | "
              f"{ours_fit / theirs_fit:.2f}x |", flush=True)
        print(f"  (the first ProfilerHook trace after the compile, HLO export included: {first_trace * 1e3:.1f} ms "
              f"on the training thread)")


if __name__ == "__main__":
    main()
