"""All hookprof callbacks of one fit share one driver, as TF's hooks shared one MonitoredSession: the hooks of
every callback see TF's call order across callbacks, one SessionRunContext per step, and a stop requested by
one callback's hook is seen by the next callback's hook in the same step."""

import keras
import lightning as L

import keras_prof
import lightning_prof
from hookprof import SessionRunHook
from tests.lightning_models import TinyModel, loader, trainer
from tests.test_keras_prof import fit, model


class OrderHook(SessionRunHook):
    """Logs (name, call, step) into a log shared by every hook; `stop_at` requests a stop at that step."""

    def __init__(self, name, log, stop_at=None):
        self.name, self.log, self.stop_at = name, log, stop_at
        self.contexts = []

    def begin(self):
        self.log.append((self.name, "begin"))

    def after_create_session(self, session, coord):
        self.log.append((self.name, "after_create_session"))

    def before_run(self, run_context):
        self.contexts.append(run_context)
        self.log.append((self.name, "before_run", run_context.session.global_step))

    def after_run(self, run_context, run_values):
        step = run_context.session.global_step
        self.log.append((self.name, "after_run", step, run_context.stop_requested))
        if self.stop_at == step:
            run_context.request_stop()

    def end(self, session):
        self.log.append((self.name, "end"))


def tf_order(names, steps, stop_at=None, stopper="a"):
    """What TF's MonitoredSession calls for hooks `names` over global steps 0..steps-1."""
    expected = [(n, "begin") for n in names] + [(n, "after_create_session") for n in names]
    for step in range(steps):
        expected += [(n, "before_run", step) for n in names]
        stopped = False
        for n in names:
            expected.append((n, "after_run", step + 1, stopped))
            stopped = stopped or (n == stopper and stop_at == step + 1)
    return expected + [(n, "end") for n in names]


class Bystander(L.Callback):
    """Someone else's callback between ours: it does not change hookprof's order."""

    def on_train_batch_start(self, *args):
        pass


def test_three_lightning_callbacks_run_as_one_session(tmp_dir):
    log = []
    a, b, c = OrderHook("a", log, stop_at=3), OrderHook("b", log), OrderHook("c", log)
    callbacks = [lightning_prof.HookCallback([a]), Bystander(), lightning_prof.HookCallback([b, c])]
    trainer(tmp_dir, callbacks, max_steps=10, logger=False).fit(TinyModel(), loader())
    assert log == tf_order("abc", 3, stop_at=3)  # a's stop at step 3 reached b and c in that same step
    assert all(x is y is z for x, y, z in zip(a.contexts, b.contexts, c.contexts))  # one context a step


def test_three_keras_callbacks_run_as_one_session():
    log = []
    a, b, c = OrderHook("a", log, stop_at=3), OrderHook("b", log), OrderHook("c", log)
    callbacks = [keras_prof.HookCallback([a]), keras.callbacks.History(), keras_prof.HookCallback([b]),
                 keras_prof.HookCallback([c])]
    fit(model(), callbacks, epochs=1)
    assert log == tf_order("abc", 3, stop_at=3)
    assert all(x is y is z for x, y, z in zip(a.contexts, b.contexts, c.contexts))


def test_the_next_keras_fit_runs_only_its_own_callbacks():
    log = []
    first, second = keras_prof.HookCallback([OrderHook("a", log)]), keras_prof.HookCallback([OrderHook("b", log)])
    m = model()
    fit(m, [first, second], epochs=1, n=16)
    log.clear()
    fit(m, [second], epochs=1, n=16)  # the same model, the first callback left out
    assert log == [("b", "begin"), ("b", "after_create_session"), ("b", "before_run", 2), ("b", "after_run", 3, False),
                   ("b", "before_run", 3), ("b", "after_run", 4, False), ("b", "end")]


def test_callbacks_reused_in_a_second_trainer_form_that_trainers_session(tmp_dir):
    log = []
    a, b = (lightning_prof.HookCallback([OrderHook(name, log)], name=name) for name in "ab")
    trainer(tmp_dir, [a, b], max_steps=2, logger=False).fit(TinyModel(), loader())
    assert log == tf_order("ab", 2)
    log.clear()
    trainer(tmp_dir, [b, a], max_steps=2, logger=False).fit(TinyModel(), loader())  # b first now
    assert log == tf_order("ba", 2)


class Boom(keras.callbacks.Callback):
    """Raises in its `on_train_batch_end` at batch `at`: a failure outside the train step."""

    def __init__(self, at):
        super().__init__()
        self.at = at

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.at:
            raise RuntimeError("boom in a callback")


def test_a_keras_retry_after_a_failure_outside_the_step_is_a_fresh_session():
    log = []
    hook = OrderHook("a", log)
    callbacks = [keras_prof.HookCallback([hook]), keras_prof.HookCallback([OrderHook("b", log)])]
    first = model()
    try:
        fit(first, [*callbacks, Boom(at=1)], epochs=1)
    except RuntimeError:
        pass
    log.clear()
    second = model()  # the notebook retry: a new model, the same callbacks
    fit(second, callbacks, epochs=1, n=16)
    assert log == tf_order("ab", 2)  # begin and after_create_session again, steps from 0 on the new model
    assert all(context.session.model is second for context in hook.contexts[-2:])


def test_a_nested_keras_fit_on_the_same_model_keeps_the_outer_session():
    log = []

    class FitAgain(keras.callbacks.Callback):  # an inner fit of the same model, once, between outer epochs
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                fit(self.model, [keras_prof.HookCallback([OrderHook("inner", log)])], epochs=1, n=8)

    m = model()
    fit(m, [keras_prof.HookCallback([OrderHook("outer", log)]), FitAgain()], epochs=2, n=16)
    outer = [entry for entry in log if entry[0] == "outer"]
    inner = [entry for entry in log if entry[0] == "inner"]
    assert [e[1] for e in outer].count("before_run") == 4 and outer[-1] == ("outer", "end")
    assert inner == [("inner", "begin"), ("inner", "after_create_session"), ("inner", "before_run", 2),
                     ("inner", "after_run", 3, False), ("inner", "end")]


def test_a_lightning_summary_hook_with_the_logger_pickles_for_ddp_spawn(tmp_dir):
    import pickle

    from lightning.pytorch.loggers import TensorBoardLogger

    from hookprof import summary

    hook = lightning_prof.SummarySaverHook(save_steps=1, summary_writer=TensorBoardLogger(tmp_dir),
                                           summary_op=summary.scalar("x", 1.0, collections=[]))
    copy = pickle.loads(pickle.dumps(hook))  # ddp_spawn sends the callbacks to its ranks so
    assert isinstance(copy.hook._writer_arg, type(hook.hook._writer_arg))


def test_two_lightning_callbacks_of_one_class_that_differ_only_by_a_callable_are_two_callbacks_by_name(tmp_dir):
    # Lightning refuses two stateful callbacks with one state_key; hooks of fetch and feed functions differ
    # only by those functions, which the key does not hold (it is the class, the schedule and `name`)
    callbacks = [lightning_prof.NanTensorHook(lambda s: s.outputs["loss"]),
                 lightning_prof.NanTensorHook(lambda s: s.outputs["loss"] * 2, name="double"),
                 lightning_prof.FeedFnHook(lambda: {"a": 1}), lightning_prof.FeedFnHook(lambda: {"b": 2}, name="b")]
    assert len({callback.state_key for callback in callbacks}) == 4
    trainer(tmp_dir, callbacks, max_steps=2, logger=False).fit(TinyModel(), loader())
    again = lightning_prof.NanTensorHook(callbacks[1].hook.loss_tensor, name="double")
    assert again.state_key == callbacks[1].state_key  # the same settings: the same key (a resume finds its state)
