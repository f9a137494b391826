"""trace_pipe lines (perfmon.parsers.trace_pipe) as the kernel writes them for the tracefs
backend's uprobe events: entries, returns, names and other lines."""

from __future__ import annotations

from perfmon.parsers.trace_pipe import classify_step_name, parse_name_arg, parse_trace_line
from perfmon.probes.uprobes import NAME_LEN_BYTES, STEP_NAME_PREFIXES


def test_parses_entry_and_return_lines_of_trace_pipe():
    line = (b"          python-14748   (  14748) [001] .....  3613.334020: rf_enter_0: "
            b'(0x7ff43aa77e90) name="Optimizer.step#AdamW.step"')
    parsed = parse_trace_line(line)
    assert parsed is not None
    assert (parsed.tid, parsed.tgid, parsed.t_mono_ns, parsed.event) == (
        14748, 14748, 3613_334_020_000, "rf_enter_0")
    assert parse_name_arg(parsed.args) == b"Optimizer.step#AdamW.step"
    assert classify_step_name(b"Optimizer.step#AdamW.step", STEP_NAME_PREFIXES
                              ) == "optimizer_step"
    assert classify_step_name(b"enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__",
                              STEP_NAME_PREFIXES) == "dataloader_next"
    assert classify_step_name(b"aten::add", STEP_NAME_PREFIXES) is None
    # A comm (16 columns wide) with spaces and dashes, no tgid recorded yet, no
    # irq-info column, and a return probe.
    ret = parse_trace_line(b"   pt-autograd 0-15001   (-------) [000]  12.000007: bw_exit_3: "
                           b"(0x7ff44a208f16 <- 0x7ff43aa3c980)")
    assert ret is not None
    assert (ret.tid, ret.tgid, ret.t_mono_ns, ret.event, ret.args) == (
        15001, None, 12_000_007_000, "bw_exit_3", b"")
    # A name the kernel could not read, a name holding quotes, other lines.
    fault = parse_trace_line(b"          python-1       (      1) [000]     1.000000: rf_enter_1: "
                             b"(0x1) name=(fault)")
    assert fault is not None and parse_name_arg(fault.args) is None
    assert parse_name_arg(b' name="a "quoted" name"') == b'a "quoted" name'
    assert parse_trace_line(b"CPU:1 [LOST 3 EVENTS]") is None
    assert parse_trace_line(b"") is None
    assert NAME_LEN_BYTES == 64  # as iterations.bpf.c's NAME_LEN
