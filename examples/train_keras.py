"""Train an MLP on the bundled two-moons data with Keras (torch backend), a timeline every 0.2 seconds."""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "torch")

from examples.models import moons_keras_model, two_moons  # noqa: E402
from keras_prof import ProfilerHook  # noqa: E402


def main(output_dir: str, epochs: int = 20, save_secs: float = 0.2) -> list[str]:
    x, y = two_moons()
    model = moons_keras_model()
    hook = ProfilerHook(save_secs=save_secs, output_dir=output_dir)
    model.fit(x, y, batch_size=64, epochs=epochs, callbacks=[hook], verbose=0)
    return hook.saved_paths


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output-dir", default="runs/demo/keras")
    parser.add_argument("--epochs", type=int, default=20)
    args = parser.parse_args()
    print("\n".join(main(args.output_dir, args.epochs)))
