"""`make demo`: train on the bundled data with Lightning and with Keras, each with a ProfilerHook.

Prints the timelines written and how to open them.
"""

import logging
import os
import shutil
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples import train_keras, train_lightning  # noqa: E402
from hookprof.trace.summary import summarize  # noqa: E402

ROOT = os.path.join("runs", "demo")


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    shutil.rmtree(ROOT, ignore_errors=True)
    print("Lightning: 300 steps, ProfilerHook(save_steps=100) ...")
    lightning_paths = train_lightning.main(os.path.join(ROOT, "lightning"))
    print("Keras (torch backend): 20 epochs, ProfilerHook(save_secs=0.2) ...")
    keras_paths = train_keras.main(os.path.join(ROOT, "keras"))
    print()
    for title, paths in (("Lightning", lightning_paths), ("Keras", keras_paths)):
        print(f"{title} timelines ({len(paths)}):")
        for path in paths:
            print(f"  {path}  {summarize(path)}")
    print(
        "\nOpen a timeline in Perfetto: https://ui.perfetto.dev -> 'Open trace file' (or drag the file in);"
        "\nor in Chrome: chrome://tracing -> 'Load'. Each op's args show its module scope, phase and inputs;"
        "\narrows follow each tensor from the op that made it to the ops that read it."
        f"\nThe same steps as graphs: .venv/bin/tensorboard --logdir {ROOT} -> Graphs -> tag step_<N>."
        f"\nA summary line per file: .venv/bin/hookprof summary {ROOT}/*/timeline-*.json"
    )
    if not lightning_paths or not keras_paths:
        sys.exit("demo: expected timelines from both runs")


if __name__ == "__main__":
    main()
