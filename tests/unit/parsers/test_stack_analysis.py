"""Stack analysis on py-spy output captured from tests/targets/train_gpt.py (see
test_pyspy.py for how each file was taken), plus stacks built from the
same real frame names and paths for the cases train_gpt.py does not run."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from perfmon.parsers.pyspy import Frame, StackSample, parse_chrometrace, parse_dump
from perfmon.parsers.stack_analysis import (
    PHASES,
    IterationDetector,
    classify_phase,
    innermost_common_frame,
    is_optimizer_step,
    iteration_from_locals,
    iteration_local,
    main_thread,
    mean_step_time_ns,
    phase_durations_ns,
)

DATA = Path(__file__).resolve().parents[2] / "data"
SITE = "/venv/lib/python3.11/site-packages"
TRAIN = Frame("train", "/job/train.py", 40)
MODULE = Frame("<module>", "/job/train.py", 99)


def _trace(name: str) -> list[StackSample]:
    data = (DATA / f"pyspy_chrometrace_{name}.json").read_bytes()
    return parse_chrometrace(data, origin_mono_ns=0)


def _stack(*inner: Frame) -> tuple[Frame, ...]:
    """A main-thread stack, innermost first, under train() and <module>."""
    return (*inner, TRAIN, MODULE)


def _torch(function: str, path: str, line: int = 1) -> Frame:
    return Frame(function, f"{SITE}/torch/{path}", line)


CALL = _torch("Module._call_impl", "nn/modules/module.py")
STEP_WRAPPER = _torch("Optimizer.profile_hook_step.<locals>.wrapper", "optim/optimizer.py")
BACKWARD = _torch("Tensor.backward", "_tensor.py")
NEXT = _torch("_BaseDataLoaderIter.__next__", "utils/data/dataloader.py")


def test_phase_rules_on_the_stacks_a_training_loop_shows():
    assert classify_phase(_stack(Frame("RandomTokens.__getitem__", "/job/train.py", 30),
                                 _torch("_MapDatasetFetcher.fetch", "utils/data/_utils/fetch.py"),
                                 NEXT)) == "data_loading"
    assert classify_phase(_stack(Frame("Block.forward", "/job/train.py", 9), CALL)) == "forward"
    assert classify_phase(_stack(_torch("cross_entropy", "nn/functional.py"))) == "forward"
    assert classify_phase(_stack(_torch("_engine_run_backward", "autograd/graph.py"),
                                 BACKWARD)) == "backward"
    assert classify_phase(_stack(_torch("_single_tensor_adam", "optim/adam.py"),
                                 STEP_WRAPPER)) == "optimizer"
    zero_grad = _torch("Module.zero_grad", "nn/modules/module.py")
    assert classify_phase(_stack(zero_grad)) == "optimizer"
    scheduler = _torch("LRScheduler.step", "optim/lr_scheduler.py")
    assert classify_phase(_stack(scheduler)) == "optimizer"
    assert classify_phase(_stack()) == "other"
    assert classify_phase(()) == "other"


def test_frames_of_torch_autograd_that_wrap_other_phases_are_not_backward():
    # As py-spy saw SGD's step on Python 3.13: record_function.__exit__ (autograd/
    # profiler.py) on the stack for a few milliseconds of every optimizer step.
    sgd = _stack(_torch("_single_tensor_sgd", "optim/sgd.py"), _torch("sgd", "optim/sgd.py"),
                 _torch("graph_break", "_dynamo/decorators.py"),
                 _torch("record_function.__exit__", "autograd/profiler.py"), STEP_WRAPPER)
    assert classify_phase(sgd) == "optimizer"
    # A custom autograd Function's forward (Megatron's tensor-parallel layers) runs
    # under Function.apply; evaluation under no_grad.
    apply = _stack(Frame("LinearWithGrad.forward", "/job/layers.py", 7),
                   _torch("Function.apply", "autograd/function.py"),
                   Frame("ColumnParallelLinear.forward", "/job/layers.py", 70), CALL)
    assert classify_phase(apply) == "forward"
    no_grad = _stack(Frame("GPT.forward", "/job/model.py", 5), CALL,
                     _torch("_NoParamDecoratorContextManager.__call__.<locals>.decorate_context",
                            "autograd/grad_mode.py"))
    assert classify_phase(no_grad) == "forward"
    # torch.autograd.grad (a gradient penalty) is backward.
    penalty = _stack(_torch("_engine_run_backward", "autograd/graph.py"),
                     _torch("grad", "autograd/__init__.py"))
    assert classify_phase(penalty) == "backward"


def test_phase_rules_for_nested_phases():
    # Activation checkpointing re-runs forward inside backward: that is backward time.
    recompute = _stack(Frame("Block.forward", "/job/train.py", 9), CALL,
                       _torch("CheckpointFunction.backward", "utils/checkpoint.py"),
                       _torch("_engine_run_backward", "autograd/graph.py"), BACKWARD)
    assert classify_phase(recompute) == "backward"
    # Lightning runs the training step as a closure inside optimizer.step().
    closure = _stack(Frame("GPT.forward", "/job/model.py", 5), CALL,
                     Frame("closure", f"{SITE}/lightning/pytorch/loops/optimization.py", 9),
                     _torch("AdamW.step", "optim/adamw.py"), STEP_WRAPPER)
    assert classify_phase(closure) == "forward"


def test_phase_of_captured_stacks():
    (in_step,) = parse_dump((DATA / "pyspy_dump_locals_train_gpt.json").read_bytes())
    (stalled,) = parse_dump((DATA / "pyspy_dump_stalled_train_gpt.json").read_bytes())
    assert classify_phase(in_step.frames) == "optimizer"
    assert classify_phase(stalled.frames) == "other"


def test_slow_data_loader_makes_data_loading_the_largest_phase():
    samples = _trace("data_delay")
    durations = phase_durations_ns(samples)
    assert list(durations) == list(PHASES)
    assert sum(durations.values()) == sum(s.duration_ns for s in samples)
    assert max(durations, key=lambda p: durations[p]) == "data_loading"
    assert durations["forward"] > 0 and durations["backward"] > 0 and durations["optimizer"] > 0


def test_iteration_boundaries_are_entries_into_optimizer_step():
    samples = _trace("train_gpt")
    boundaries = IterationDetector().feed(samples)
    # 2 s of a ~0.4 s step: 5 entries, the first without a step time.
    assert len(boundaries) == 5
    assert boundaries[0].step_time_ns is None
    assert all(300e6 < b.step_time_ns < 500e6 for b in boundaries[1:])  # type: ignore[operator]
    index = {s.t_mono_ns: i for i, s in enumerate(samples)}
    for b in boundaries:
        i = index[b.t_mono_ns]
        assert any(is_optimizer_step(f) for f in samples[i].frames)
        assert not any(is_optimizer_step(f) for f in samples[i - 1].frames)
    mean = mean_step_time_ns(boundaries)
    assert mean == (boundaries[-1].t_mono_ns - boundaries[0].t_mono_ns) / 4  # telescopes


def test_iteration_function_regex_replaces_the_optimizer_rule():
    samples = _trace("train_gpt")
    by_backward = IterationDetector(r"^Tensor\.backward$").feed(samples)
    assert len(by_backward) >= 4
    assert IterationDetector(r"^no_such_function$").feed(samples) == []


def test_lr_scheduler_step_is_not_a_second_boundary():
    step = _stack(_torch("Adam.step", "optim/adam.py"), STEP_WRAPPER)
    sched = _stack(_torch("LRScheduler.step", "optim/lr_scheduler.py"))
    outside = _stack(CALL)
    stacks = [outside, step, sched, outside, step, sched]
    samples = [StackSample(i * 30_000_000, 1, 1, frames, 30_000_000)
               for i, frames in enumerate(stacks)]
    boundaries = IterationDetector().feed(samples)
    assert [b.t_mono_ns for b in boundaries] == [30_000_000, 120_000_000]
    assert boundaries[1].step_time_ns == 90_000_000


def test_a_flicker_out_of_the_step_is_not_a_new_iteration():
    # Where two windows are joined their clocks differ by a few ms, which can
    # show a step as left and re-entered; so can a misread non-blocking sample.
    step = _stack(_torch("Adam.step", "optim/adam.py"), STEP_WRAPPER)
    outside = _stack(CALL)
    durations_ms = [(outside, 100), (step, 40), (outside, 5), (step, 40), (outside, 100),
                    (step, 40)]
    samples, t = [], 0
    for frames, ms in durations_ms:
        samples.append(StackSample(t, 1, 1, frames, ms * 1_000_000))
        t += ms * 1_000_000
    boundaries = IterationDetector().feed(samples)
    assert [b.t_mono_ns // 1_000_000 for b in boundaries] == [100, 285]


def test_a_hole_in_the_samples_breaks_the_step_time_chain():
    samples = _trace("train_gpt")
    cut = len(samples) // 2
    later = [replace(s, t_mono_ns=s.t_mono_ns + 5_000_000_000) for s in samples[cut:]]
    boundaries = IterationDetector().feed(samples[:cut] + later)
    after_hole = [b for b in boundaries if b.t_mono_ns >= later[0].t_mono_ns]
    assert after_hole and after_hole[0].step_time_ns is None
    assert all(b.step_time_ns is None or b.step_time_ns < 1e9 for b in boundaries)


def test_innermost_common_frame_of_stalled_ranks():
    (stalled,) = parse_dump((DATA / "pyspy_dump_stalled_train_gpt.json").read_bytes())
    # Another rank on another line of the same function.
    rank1 = (replace(stalled.frames[0], line=71), *stalled.frames[1:])
    common = innermost_common_frame([stalled.frames, rank1])
    assert common is not None and common.function == "deliberately_stalled_collective"
    assert common.line == stalled.frames[0].line  # the first stack's frame
    (busy,) = parse_dump((DATA / "pyspy_dump_locals_train_gpt.json").read_bytes())
    assert innermost_common_frame([stalled.frames, busy.frames]).function == "train"  # type: ignore[union-attr]
    assert innermost_common_frame([stalled.frames]) == stalled.frames[0]
    assert innermost_common_frame([stalled.frames, (Frame("run", "/other.py", 1),)]) is None
    assert innermost_common_frame([]) is None


def test_iteration_number_from_locals():
    threads = parse_dump((DATA / "pyspy_dump_locals_train_gpt.json").read_bytes())
    assert main_thread(threads) is threads[0]
    # The target had written iteration 12's timestamp and was inside its optimizer
    # step, before `iteration += 1`: its local still read 11.
    assert iteration_from_locals(threads) == 11
    # Frames come before names: train()'s `iteration` beats the `step` local of
    # Adam's _single_tensor_adam, deeper down (py-spy shows its repr as '?').
    assert iteration_local(threads, ("step", "iteration")) == ("iteration", 11)
    assert iteration_from_locals(threads, ("ffn",)) == 4 * 512  # any named integer local
    assert iteration_from_locals(threads, ("loss",)) is None  # a tensor is not a number
    assert iteration_from_locals(threads, ("no_such_name",)) is None
    assert iteration_from_locals([]) is None
    # A read that raced the frame (seen under load in CI: a garbage number) is no count.
    main = threads[0]
    for garbage in ("-4669202389988461694", str(10**15)):
        raced = replace(main, frame_locals=[{**f, "iteration": garbage}
                                            for f in main.frame_locals])
        assert iteration_local([raced], ("iteration",)) is None, garbage
