"""Real Keras fits on the JAX backend with hookprof's callbacks, run in their own process (KERAS_BACKEND is read
when keras is imported): `python -m tests.keras_jax_fit OUT` writes `OUT/result.json` (and the files the
callbacks wrote) for tests/test_keras_jax.py to read back."""

import json
import os
import sys

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_prof import (  # noqa: E402
    CheckpointSaverHook,
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


if __name__ == "__main__":
    main(sys.argv[1])
