"""TensorBoard summaries as TF1 had them, made lazy for eager frameworks.

`scalar`, `histogram`, `image`, `text` and `audio` register a summary op in collections (default
`SUMMARIES`, as `tf.GraphKeys.SUMMARIES`); `merge` and `merge_all` gather them; `Scaffold(summary_op=...)`
carries one. A summary's value is a constant or a callable of the finished step (`hookprof.StepState`: `.outputs`,
`.batch`, `.model`, `.metrics`, `.step`), evaluated only on the steps a `SummarySaverHook` writes, so other
steps cost nothing. Values may be torch tensors, numpy arrays, keras/JAX arrays or Python numbers; they are
moved to host only when written. Protos come from TensorBoard's own summary builders (scalar, histogram,
text) or its `Summary.Image`/`Summary.Audio` messages (PNG via Pillow, WAV via the standard library).

    from hookprof import summary
    summary.scalar("loss", lambda step: step.outputs["loss"])
    summary.histogram("fc1/weight", lambda step: step.model.fc1.weight)
    summary.image("inputs", lambda step: step.batch[0][:4])
    hook = SummarySaverHook(save_steps=50, summary_op=summary.merge_all())
"""

from __future__ import annotations

import io
import logging
import wave
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from hookprof._runtime.values import backend_value

log = logging.getLogger(__name__)

SUMMARIES = "summaries"  # tf.GraphKeys.SUMMARIES
_collections: dict[str, list[SummaryOp]] = {}


class SummaryError(ValueError):
    """A summary could not be evaluated or its value has the wrong kind; the message names the summary."""


def to_numpy(value: Any) -> np.ndarray:
    """A host numpy array from a torch tensor (detached, moved to CPU), keras/JAX/TF array, or Python value (a
    Keras variable read through its backend tensor: `hookprof._runtime.values.backend_value`)."""
    value = backend_value(value)
    if hasattr(value, "detach"):  # torch
        value = value.detach()
        if hasattr(value, "cpu"):
            value = value.cpu()
        if str(getattr(value, "dtype", "")) == "torch.bfloat16":
            value = value.float()
        return value.numpy()
    if hasattr(value, "numpy") and not isinstance(value, np.ndarray):  # tf / keras-on-tf
        try:
            return _no_bfloat16(np.asarray(value.numpy()))
        except (TypeError, ValueError, AttributeError):
            pass
    return _no_bfloat16(np.asarray(value))


def _no_bfloat16(array: np.ndarray) -> np.ndarray:
    """bfloat16 (JAX's and TF's, an ml_dtypes type numpy cannot summarise) as float32; anything else as is."""
    return array.astype(np.float32) if array.dtype.name == "bfloat16" else array


class SummaryOp:
    """One lazy summary: its kind, name, and value (a constant, or a callable of the finished step)."""

    def __init__(self, kind: str, name: str, value: Any, build: Callable[[str, np.ndarray], list],
                 family: str | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"summary.{kind}(name={name!r}): `name` must be a non-empty string.")
        self.kind = kind
        self.name = f"{family}/{name}" if family else name
        self.value = value
        self._build = build
        if not callable(value):  # a constant of the wrong kind fails now, not at the first saving step
            self.values(None)

    def values(self, state: Any) -> list:
        """The `Summary.Value` protos of this summary for `state` (the finished step)."""
        step = getattr(state, "step", None)
        try:
            raw = self.value(state) if callable(self.value) else self.value
        except Exception as err:
            raise SummaryError(f"summary {self.name!r} ({self.kind}) at step {step}: its value function "
                               f"raised {type(err).__name__}: {err}") from err
        try:
            array = raw if isinstance(raw, str) and self.kind == "text" else to_numpy(raw)
            return self._build(self.name, array)
        except SummaryError as err:
            raise SummaryError(f"summary {self.name!r} ({self.kind}) at step {step}: {err}") from None
        except Exception as err:
            raise SummaryError(f"summary {self.name!r} ({self.kind}) at step {step}: cannot use a "
                               f"{type(raw).__name__} ({err})") from err

    def __repr__(self) -> str:
        return f"<summary.{self.kind} {self.name!r}>"


class MergedSummary:
    """`merge` / `merge_all`: several summary ops written together."""

    def __init__(self, ops: Sequence[SummaryOp | MergedSummary]) -> None:
        flat: list[SummaryOp] = []
        for op in ops:
            if isinstance(op, MergedSummary):
                flat.extend(op.ops)
            elif isinstance(op, SummaryOp):
                flat.append(op)
            else:
                raise TypeError(f"summary.merge: {op!r} is not a summary op (summary.scalar, histogram, ...).")
        self.ops = tuple(flat)

    def evaluate(self, state: Any, strict: bool = False, on_error: Callable[[SummaryError], None] | None = None
                 ) -> Any:
        """One `Summary` proto with every op's values; a failing op is skipped (reported to `on_error`)
        unless `strict`, when its error is raised."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        proto = Summary()
        for op in self.ops:
            try:
                proto.value.extend(op.values(state))
            except SummaryError as err:
                if strict:
                    raise
                (on_error or _log_error)(err)
        return proto

    def __repr__(self) -> str:
        return f"<summary.merge of {len(self.ops)}: {', '.join(op.name for op in self.ops)}>"


def _log_error(err: SummaryError) -> None:
    log.warning("%s; the other summaries are written.", err)


def _register(op: SummaryOp, collections: Iterable[str] | None) -> SummaryOp:
    for key in [SUMMARIES] if collections is None else collections:
        _collections.setdefault(key, []).append(op)
    return op


def get_collection(key: str = SUMMARIES) -> list[SummaryOp]:
    """The summary ops registered under `key`, in order."""
    return list(_collections.get(key, []))


def clear_collection(key: str = SUMMARIES) -> None:
    """Forget the summary ops registered under `key` (TF's graph reset, for notebooks and tests)."""
    _collections.pop(key, None)


def merge(inputs: Sequence[SummaryOp | MergedSummary], collections: Iterable[str] | None = None) -> MergedSummary:
    """Merge summary ops into one (TF's `tf.summary.merge`)."""
    merged = MergedSummary(inputs)
    for key in collections or ():
        _collections.setdefault(key, []).extend(merged.ops)
    return merged


def merge_all(key: str = SUMMARIES) -> MergedSummary | None:
    """Merge every op in collection `key`; None when there is none, as TF returned."""
    ops = _collections.get(key)
    return MergedSummary(ops) if ops else None


def collection_keys() -> list[str]:
    """The keys of the collections that hold summary ops, sorted."""
    return sorted(key for key, ops in _collections.items() if ops)


class EmptyCollectionError(ValueError):
    """A collection key that selects no summaries; the message names the key and the keys that hold some."""


class CollectionSummary(MergedSummary):
    """`merge_all(key)` taken when the summaries are needed, not when this is made: a collection selected by key.

    For config files (LightningCLI's `summary_op: summaries`): the summaries are registered in code, in any
    order (a LightningModule's `__init__`, a module's top level), and the hook names their collection. `resolve()`
    merges the collection now (`lightning_prof.SummarySaverHook` calls it as each fit starts); `ops` resolves at
    its first use. A key whose collection is empty or unknown raises `EmptyCollectionError`, naming the key and
    the keys that hold summaries.
    """

    def __init__(self, key: str, argument: str = "summary_op") -> None:
        if not isinstance(key, str) or not key:
            raise TypeError(f"`{argument}`: a collection key must be a non-empty string; got {key!r}.")
        self.key = key
        self._argument = argument
        self._ops: tuple[SummaryOp, ...] | None = None

    @property
    def ops(self) -> tuple[SummaryOp, ...]:  # (MergedSummary's is a plain attribute, set in its __init__)
        if self._ops is None:
            self.resolve()
        return self._ops

    def resolve(self) -> tuple[SummaryOp, ...]:
        """The collection's ops as of now (kept for the writes that follow); raises EmptyCollectionError."""
        ops = _collections.get(self.key)
        if not ops:
            keys = ", ".join(repr(key) for key in collection_keys()) or "none"
            raise EmptyCollectionError(
                f"{self._argument}={self.key!r}: no summaries are registered in collection {self.key!r}; the "
                f"collections with summaries are: {keys}. Register summaries with collections=[{self.key!r}] "
                f"(those without `collections` go to {SUMMARIES!r}) before training starts, or name one of those.")
        self._ops = tuple(ops)
        return self._ops

    def __getstate__(self) -> dict:
        # sent to another process (ddp_spawn) as its key: the ops (callables) are taken there, from its registry
        return {**self.__dict__, "_ops": None}

    def __repr__(self) -> str:
        if self._ops is None:
            return f"<summary.merge_all({self.key!r}), not resolved yet>"
        return super().__repr__()


class Scaffold:
    """TF's `Scaffold`, for what the summary hooks use: `summary_op` (default: `merge_all()` when asked)."""

    def __init__(self, summary_op: SummaryOp | MergedSummary | None = None) -> None:
        self._summary_op = summary_op

    @property
    def summary_op(self) -> MergedSummary | None:
        if self._summary_op is None:
            return merge_all()
        return as_merged(self._summary_op, "Scaffold(summary_op=...)")


def as_merged(op: Any, argument: str) -> MergedSummary:
    """A summary op, a merged one, or a list of them, as one MergedSummary; anything else names `argument`."""
    if isinstance(op, MergedSummary):
        return op
    if isinstance(op, SummaryOp):
        return MergedSummary([op])
    if isinstance(op, (list, tuple)) and op and all(isinstance(o, (SummaryOp, MergedSummary)) for o in op):
        return MergedSummary(op)
    hint = f" (to select the collection {op!r}, pass summary.CollectionSummary({op!r}))" if isinstance(op, str) else ""
    raise TypeError(f"`{argument}` must be a summary op (hookprof.summary.scalar/histogram/image/text/audio), "
                    f"a merge of them, or a list of them; got {op!r}{hint}.")


# --- the kinds --------------------------------------------------------------------------------------------

def scalar_values(name: str, array: np.ndarray) -> list:
    """The `Summary.Value`s of a scalar summary `name` (TensorBoard's scalars plugin), from a one-number array."""
    from tensorboard.plugins.scalar.summary_v2 import scalar_pb

    if array.dtype.kind in "US":
        raise SummaryError(f"a scalar needs one number, got the string {str(array.reshape(-1)[0])!r}")
    if array.size != 1 or not (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_):
        raise SummaryError(f"a scalar needs one number, got {array.dtype} of shape {list(array.shape)}")
    return list(scalar_pb(name, float(array.reshape(()))).value)


def scalar(name: str, value: Any, collections: Iterable[str] | None = None, family: str | None = None) -> SummaryOp:
    """A scalar (a number, or a one-element tensor)."""
    return _register(SummaryOp("scalar", name, value, scalar_values, family), collections)


def histogram(name: str, values: Any, collections: Iterable[str] | None = None, family: str | None = None,
              buckets: int = 30) -> SummaryOp:
    """A histogram of every element of a tensor (e.g. a weight), with `buckets` buckets."""
    from tensorboard.plugins.histogram.summary_v2 import histogram_pb

    def build(tag: str, array: np.ndarray) -> list:
        if not np.issubdtype(array.dtype, np.number):
            raise SummaryError(f"a histogram needs numbers, got {array.dtype}")
        flat = array.astype(np.float64).reshape(-1)
        if flat.size and not np.isfinite(flat).all():
            raise SummaryError("a histogram needs finite numbers (the tensor has NaN or inf)")
        return list(histogram_pb(tag, flat, buckets=buckets).value)

    return _register(SummaryOp("histogram", name, values, build, family), collections)


def text(name: str, data: Any, collections: Iterable[str] | None = None, family: str | None = None) -> SummaryOp:
    """Text (a string, or an array of strings), shown as markdown by TensorBoard."""
    from tensorboard.plugins.text.summary_v2 import text_pb

    def build(tag: str, array: Any) -> list:
        if isinstance(array, str):
            return list(text_pb(tag, array).value)
        if array.dtype.kind not in "US":
            raise SummaryError(f"text needs strings, got {array.dtype}")
        return list(text_pb(tag, array.astype(str)).value)

    return _register(SummaryOp("text", name, data, build, family), collections)


def image(name: str, images: Any, max_outputs: int = 3, collections: Iterable[str] | None = None,
          family: str | None = None, data_format: str | None = None) -> SummaryOp:
    """Images: `[N, H, W, C]` or one `[H, W, C]` (TF's layout), uint8 0-255 or floats in [0, 1].

    `data_format` is `"NHWC"` or `"NCHW"`; None takes the framework's layout where it has one (Keras'
    `image_data_format()`, channels_last by default, on every backend), else torch tensors as NCHW (torch's
    layout) and everything else as NHWC. C is 1 (grey), 3 (RGB) or 4 (RGBA). At most `max_outputs` images are
    written.
    """
    if data_format not in (None, "NHWC", "NCHW"):
        raise ValueError(f"summary.image(data_format={data_format!r}): use 'NHWC', 'NCHW' or None.")
    layout: dict[str, str] = {}

    def value(state: Any) -> Any:
        raw = images(state) if callable(images) else images
        framework = getattr(getattr(state, "session", None), "image_format", None)
        layout["format"] = data_format or framework or ("NCHW" if type(raw).__module__.startswith("torch") else "NHWC")
        return raw

    def build(tag: str, array: np.ndarray) -> list:
        return _image_values(tag, array, layout.get("format", data_format or "NHWC"), max_outputs)

    return _register(SummaryOp("image", name, value, build, family), collections)


def _image_values(tag: str, array: np.ndarray, data_format: str, max_outputs: int) -> list:
    from PIL import Image
    from tensorboard.compat.proto.summary_pb2 import Summary

    if array.ndim == 3:
        array = array[None]
    if array.ndim != 4:
        raise SummaryError(f"an image needs 3 or 4 dimensions ([N,] H, W, C), got shape {list(array.shape)}")
    if data_format == "NCHW":
        array = array.transpose(0, 2, 3, 1)
    channels = array.shape[-1]
    if channels not in (1, 3, 4):
        raise SummaryError(f"an image needs 1, 3 or 4 channels, got {channels} (shape {list(array.shape)} as "
                           f"{data_format}; pass data_format= if the layout is the other one)")
    if array.dtype != np.uint8:
        if not np.issubdtype(array.dtype, np.number):
            raise SummaryError(f"an image needs numbers, got {array.dtype}")
        array = (np.clip(array.astype(np.float64), 0.0, 1.0) * 255).round().astype(np.uint8)
    values = []
    for i, picture in enumerate(array[:max_outputs]):
        buffer = io.BytesIO()
        mode = {1: "L", 3: "RGB", 4: "RGBA"}[channels]
        Image.fromarray(picture[..., 0] if channels == 1 else picture, mode).save(buffer, format="PNG")
        height, width = picture.shape[:2]
        suffix = f"/image/{i}" if len(array) > 1 and max_outputs > 1 else "/image"
        values.append(Summary.Value(tag=tag + suffix, image=Summary.Image(
            height=height, width=width, colorspace=channels, encoded_image_string=buffer.getvalue())))
    return values


def audio(name: str, audio_data: Any, sample_rate: int, max_outputs: int = 3,
          collections: Iterable[str] | None = None, family: str | None = None) -> SummaryOp:
    """Audio clips: `[N, frames, channels]` or `[N, frames]`, floats in [-1, 1], at `sample_rate` Hz."""
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or sample_rate <= 0:
        raise ValueError(f"summary.audio(sample_rate={sample_rate!r}): `sample_rate` must be an int > 0 (Hz).")

    def build(tag: str, array: np.ndarray) -> list:
        from tensorboard.compat.proto.summary_pb2 import Summary

        if array.ndim == 2:
            array = array[..., None]
        if array.ndim != 3 or not np.issubdtype(array.dtype, np.number):
            raise SummaryError(f"audio needs numbers shaped [N, frames(, channels)], got {array.dtype} "
                               f"{list(array.shape)}")
        values = []
        for i, clip in enumerate(array[:max_outputs]):
            pcm = (np.clip(clip.astype(np.float64), -1, 1) * 32767).round().astype("<i2")
            buffer = io.BytesIO()
            with wave.open(buffer, "wb") as out:
                out.setnchannels(clip.shape[1])
                out.setsampwidth(2)
                out.setframerate(sample_rate)
                out.writeframes(pcm.tobytes())
            suffix = f"/audio/{i}" if len(array) > 1 and max_outputs > 1 else "/audio"
            values.append(Summary.Value(tag=tag + suffix, audio=Summary.Audio(
                sample_rate=float(sample_rate), num_channels=clip.shape[1], length_frames=clip.shape[0],
                encoded_audio_string=buffer.getvalue(), content_type="audio/wav")))
        return values

    return _register(SummaryOp("audio", name, audio_data, build, family), collections)


__all__ = [
    "SUMMARIES", "CollectionSummary", "EmptyCollectionError", "MergedSummary", "Scaffold", "SummaryError",
    "SummaryOp", "audio", "clear_collection", "collection_keys", "get_collection", "histogram", "image", "merge",
    "merge_all", "scalar", "text", "to_numpy",
]
