"""Real Keras fits on the JAX backend with hookprof's callbacks, run in their own process (KERAS_BACKEND is read
when keras is imported): `python -m tests.keras_jax_fit OUT` writes `OUT/result.json` (and the files the
callbacks wrote) for tests/test_keras_jax.py to read back."""

import json
import os
import sys
import time

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from hookprof import step_feeds  # noqa: E402
from keras_prof import (  # noqa: E402
    CheckpointSaverHook,
    FeedFnHook,
    HookCallback,
    Profiler,
    ProfilerHook,
    SessionRunArgs,
    SessionRunHook,
    SummarySaverHook,
    latest_checkpoint,
    summary,
)

STEPS = 6  # one epoch of 48 samples in batches of 8


def fc1_kernel(step):
    """fc1's kernel after the step, a JAX array (Keras on JAX keeps the weights out of the model during `fit`:
    keras_prof syncs them into it before a hook reads the step)."""
    return step.model.get_layer("fc1").kernel.value


class FetchKernel(SessionRunHook):
    """Fetches fc1's kernel (a JAX array) every step and notes what it got back, and the kernel's sum."""

    def __init__(self):
        self.jax_arrays: list[bool] = []
        self.sums: dict[int, float] = {}

    def before_run(self, run_context):
        return SessionRunArgs(fetches={"kernel": fc1_kernel})

    def after_run(self, run_context, run_values):
        kernel = run_values.results["kernel"]
        self.jax_arrays.append(isinstance(kernel, jax.Array))
        self.sums[run_context.session.global_step] = float(np.asarray(kernel, dtype=np.float64).sum())


def tiny_model(name="tiny"):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="fc1"),
                              keras.layers.Dense(1, name="fc2")], name=name)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def data(n=8 * STEPS):
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, 8)).astype("float32"), rng.standard_normal((n, 1)).astype("float32")


def main(out: str) -> None:
    x, y = data()
    model = tiny_model()
    profiler = Profiler()
    hook = ProfilerHook(save_steps=2, output_dir=os.path.join(out, "timelines"), profiler=profiler, with_stack=True)
    kernel = summary.merge([
        summary.scalar("kernel_sum", lambda step: jnp.sum(fc1_kernel(step)), collections=[]),
        summary.histogram("fc1/kernel", fc1_kernel, collections=[]),
    ])
    saver = SummarySaverHook(save_steps=2, output_dir=os.path.join(out, "logs"), summary_op=kernel)
    fetch = FetchKernel()
    model.fit(x, y, batch_size=8, epochs=1, callbacks=[hook, saver, HookCallback([fetch])], verbose=0)
    with open(os.path.join(out, "run.prof"), "wb") as f:
        f.write(profiler.serialize_to_string())

    # a user's own jax.profiler trace around a fit: hookprof steps aside, the user's trace is whole
    user_hook = ProfilerHook(save_steps=2, output_dir=os.path.join(out, "beside_user_trace"))
    with jax.profiler.trace(os.path.join(out, "user_trace")):
        tiny_model("second").fit(x, y, batch_size=8, epochs=1, callbacks=[user_hook], verbose=0)

    # CheckpointSaverHook alone (no hook fetches anything): each save holds that step's weights and optimizer
    alone = tiny_model("alone")
    alone.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    checkpoints = os.path.join(out, "ckpt")
    checkpoint_hook = CheckpointSaverHook(checkpoints, save_steps=2)
    alone.fit(x, y, batch_size=8, epochs=1, callbacks=[checkpoint_hook], verbose=0)
    latest = keras.models.load_model(latest_checkpoint(checkpoints))
    saved = sorted(int(name.split("-")[1].split(".")[0]) for name in os.listdir(checkpoints) if name.endswith(".keras"))

    result = {
        "backend": keras.backend.backend(),
        "checkpoint_steps": saved,
        "checkpoint_dropped": checkpoint_hook.hook.dropped_outputs,
        "latest_iterations": int(latest.optimizer.iterations.numpy()),
        "latest_equals_model": all(np.array_equal(a, b) for a, b in zip(latest.get_weights(), alone.get_weights())),
        "paths": hook.saved_paths,
        "fetched_jax_arrays": fetch.jax_arrays,
        "kernel_sums": fetch.sums,
        "kernel_size": int(np.prod(model.get_layer("fc1").kernel.shape)),
        "beside_user_trace": user_hook.saved_paths,
    }
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f)


class EndProbe(SessionRunHook):
    """Notes the global step of each finished step and whether `end()` ran."""

    def __init__(self):
        self.steps: list[int] = []
        self.ended = False

    def after_run(self, run_context, run_values):
        self.steps.append(run_context.session.global_step)

    def end(self, session):
        self.ended = True


def slow_batches(x, y, seconds=0.04):
    """The batches of (x, y) from a Python generator that takes `seconds` to make each (a slow input pipeline;
    a generator has no length: the epoch ends when it runs out, inside the step that finds it empty)."""
    for i in range(0, len(x), 8):
        time.sleep(seconds)
        yield x[i:i + 8], y[i:i + 8]


def phase_us(path, phase):
    """The duration of the step's `phase` span (`data_wait`, `forward`, ...) in a timeline, microseconds."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return round(sum(e["dur"] for e in events if e.get("cat") == "Span" and e.get("name") == phase))


def phase_spans(path):
    """The step's phase spans in a timeline, in time order: [name, start us, duration us]."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    spans = [e for e in events if e.get("cat") == "Span"]
    return [[e["name"], e["ts"], round(e["dur"])] for e in sorted(spans, key=lambda e: e["ts"])]


class FedScale(keras.Sequential):
    """Scales its loss by the fed `scale` and notes each step's value (a Python side effect: seen only when the
    train step runs as Python, i.e. eagerly)."""

    seen: list[float] = []

    def compute_loss(self, *args, **kwargs):
        scale = step_feeds().get("scale", 1.0)
        FedScale.seen.append(float(scale))
        return super().compute_loss(*args, **kwargs) * scale


class FeedsFromStep(SessionRunHook):
    """A user hook that feeds `scale` = the coming step's number through SessionRunArgs, from step `first` on."""

    def __init__(self, first):
        self.first = first

    def before_run(self, run_context):
        step = run_context.session.global_step + 1
        return SessionRunArgs(feed_dict={"scale": float(step)}) if step >= self.first else None


def fed_model(**compile_args):
    keras.utils.set_random_seed(0)
    model = FedScale([keras.Input((8,)), keras.layers.Dense(1, name="fc")], name="fed")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", **compile_args)
    return model


def configs(out: str) -> None:
    """Keras-on-JAX configurations: a slow input pipeline, a train step without jit, feeds under jit."""
    x, y = data()
    result = {}

    # a 40 ms generator: the batch loads in the step's data wait (as on torch), not in its forward pass
    slow = ProfilerHook(save_steps=2, output_dir=os.path.join(out, "slow"), tensorboard=False)
    probe = EndProbe()
    tiny_model("slow").fit(slow_batches(x, y), epochs=1, callbacks=[slow, HookCallback([probe])], verbose=0)
    result["slow"] = {"paths": [os.path.basename(p) for p in slow.saved_paths],
                      "data_wait_us": [phase_us(p, "data_wait") for p in slow.saved_paths],
                      "forward_us": [phase_us(p, "forward") for p in slow.saved_paths],
                      "steps": probe.steps, "ended": probe.ended}

    # steps_per_execution=4: the call fetches its later batches between its jitted steps, each in a data wait
    grouped = tiny_model("grouped")
    grouped.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=4)
    grouped_profiler = Profiler()
    traced = ProfilerHook(save_steps=4, output_dir=os.path.join(out, "grouped"), tensorboard=False,
                          profiler=grouped_profiler)
    x12, y12 = data(8 * 12)
    grouped.fit(slow_batches(x12, y12), epochs=1, callbacks=[traced], verbose=0)
    result["grouped"] = {"paths": [os.path.basename(p) for p in traced.saved_paths],
                         "spans": [phase_spans(p) for p in traced.saved_paths],
                         "profile": {step: [summary.data_wait_micros, summary.step_micros]
                                     for (_, step), summary in grouped_profiler.data.steps.items()}}

    # the same with an epoch of 10 batches: its last call runs 2 and finds the generator empty at its third fetch
    uneven = tiny_model("uneven")
    uneven.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=4)
    ends, counted = ProfilerHook(save_steps=3, output_dir=os.path.join(out, "uneven"), tensorboard=False), EndProbe()
    x10, y10 = data(8 * 10)
    uneven.fit(slow_batches(x10, y10, seconds=0.01), epochs=1, callbacks=[ends, HookCallback([counted])], verbose=0)
    result["uneven"] = {"paths": [os.path.basename(p) for p in ends.saved_paths],
                        "spans": [phase_spans(p) for p in ends.saved_paths], "steps": counted.steps,
                        "iterations": int(uneven.optimizer.iterations.numpy())}

    # jit_compile=False: one warning saying why the ops have no scopes
    eager = tiny_model("eager")
    eager.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", jit_compile=False)
    unjitted = ProfilerHook(save_steps=2, output_dir=os.path.join(out, "unjitted"), tensorboard=False)
    eager.fit(x, y, batch_size=8, epochs=2, callbacks=[unjitted], verbose=0)
    result["unjitted_paths"] = len(unjitted.saved_paths)

    # FeedFnHook: refused under jit before any step, fed every step when the step runs eagerly
    scales = iter([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    jitted = fed_model()
    try:
        jitted.fit(x, y, batch_size=8, epochs=1, callbacks=[FeedFnHook(lambda: {"scale": next(scales)})], verbose=0)
    except ValueError as error:
        result["feed_under_jit"] = str(error)
    result["feed_under_jit_iterations"] = int(jitted.optimizer.iterations.numpy())
    FedScale.seen.clear()
    scales = iter([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    fed_model(run_eagerly=True).fit(x, y, batch_size=8, epochs=1,
                                    callbacks=[FeedFnHook(lambda: {"scale": next(scales)})], verbose=0)
    result["fed_eagerly"] = list(FedScale.seen)

    # a user hook that feeds through SessionRunArgs(feed_dict=...): refused under jit at its first feeding step,
    # fed each step without jit
    FedScale.seen.clear()
    jitted = fed_model()
    try:
        jitted.fit(x, y, batch_size=8, epochs=1, callbacks=[HookCallback([FeedsFromStep(2)])], verbose=0)
    except ValueError as error:
        result["user_feed_under_jit"] = str(error)
    result["user_feed_under_jit_iterations"] = int(jitted.optimizer.iterations.numpy())
    FedScale.seen.clear()
    fed_model(jit_compile=False).fit(x, y, batch_size=8, epochs=1, callbacks=[HookCallback([FeedsFromStep(2)])],
                                     verbose=0)
    result["user_fed_unjitted"] = list(FedScale.seen)
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    configs(sys.argv[1]) if sys.argv[2:] == ["configs"] else main(sys.argv[1])
