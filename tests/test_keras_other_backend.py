"""keras_prof on a non-torch backend (JAX): two fits in one process, each traced at the op level, no warning."""

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import keras, numpy as np
    from hookprof import summary
    from keras_prof import ProfilerHook, SummarySaverHook
    out = sys.argv[1]
    loss = summary.scalar("loss", lambda step: step.outputs["loss"])
    x = np.random.default_rng(0).standard_normal((32, 8)).astype("float32"); y = x[:, :1]
    paths = []
    for run, (name, layer) in enumerate([("first", "fc1"), ("second", "encoder")]):
        m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, name=layer), keras.layers.Dense(1)],
                             name=name)
        m.compile(optimizer="sgd", loss="mse")
        hook = ProfilerHook(save_steps=2, output_dir=os.path.join(out, str(run)))
        saver = SummarySaverHook(save_steps=2, output_dir=os.path.join(out, "logs", str(run)), summary_op=loss)
        m.fit(x, y, batch_size=8, epochs=1, callbacks=[hook, saver], verbose=0)
        paths.append(hook.saved_paths)
    print(json.dumps({"backend": keras.backend.backend(), "paths": paths}))
""")


def test_jax_backend_traces_xla_ops_of_each_fit_without_a_warning(tmp_path):
    env = {**os.environ, "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["backend"] == "jax"
    assert [[os.path.basename(p) for p in paths] for paths in result["paths"]] == [
        ["timeline-2.json", "timeline-4.json"]] * 2
    assert "the Keras backend is" not in done.stderr, done.stderr  # op-level tracing: nothing to warn about
    for paths, scope in zip(result["paths"], ("first/fc1", "second/encoder")):
        for path in paths:  # the second model's program, compiled after the first fit's traces, is read too
            trace = json.load(open(path))
            assert trace["metadata"]["tracer"] == "jax"
            ops = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "Op"]
            assert {e["args"]["hlo_module"] for e in ops} == {"jit_train_step"}
            assert scope in {e["args"].get("scope") for e in ops}, path

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "logs" / "1"), size_guidance={"tensors": 0})
    acc.Reload()
    assert [e.step for e in acc.Tensors("loss")] == [1, 3]  # summaries need no tracer: JAX works too
