// CUDA and NCCL activity of PyTorch processes, counted in the kernel.
//
// Nothing leaves the kernel per call: every probe adds to a per-process array
// of u64 counters (hash `pids`, keyed by tgid, one entry per target created by
// user space before any probe is attached), and user space reads the whole
// array when it polls. A call from a process without an entry is ignored.
// The one exception is an iteration boundary: at the entry of each
// Optimizer.step (PyTorch's record_function, as in iterations.bpf.c) the
// process's whole array is copied, with the time, into the ring buffer
// `step_events`, so per-iteration differences are exact whatever the polling.
//
// Counters:
// - kernel and graph launches, at the entry of libcudart/libcuda launch entry
//   points. The runtime hands each launch to the driver, so a driver entry
//   point is also entered from inside libcudart; such a call (its return
//   address lies in the executable mapping of libcudart or libcuda of that
//   process, `text_lo/text_hi`) is counted apart as FORWARDED, so one launch
//   is counted once whichever layer the program called.
// - time blocked in the runtime's synchronising calls: entry stores a
//   timestamp per thread, the return probe adds the difference. A blocking
//   call made from inside another (cudaDeviceSynchronize waiting in
//   cudaStreamSynchronize) is recognised by its stack pointer and not timed
//   again, so the outer call's time is counted once.
// - NCCL calls and bytes per collective: bytes = count argument x size of the
//   ncclDataType_t, from `nccl_dtype_bytes`, filled by user space (a constant
//   table here would land in .rodata, which bcc 0.26 cannot load).
//
// Settings arrive as -D cflags from probes/cuda.py (the counter numbering is
// probes/cuda_counters.py's): N_COUNTERS, one CTR_<NAME> per counter, MAX_TEXT_RANGES,
// MAX_TARGETS, MAX_SYNC_THREADS, NCCL_DTYPES, STEP_EVENT_PAGES; and those of
// step_names.bpf.h.

#include <uapi/linux/ptrace.h>

#include "step_names.bpf.h"

#ifndef N_COUNTERS
#error "N_COUNTERS and the CTR_* ids come from probes/cuda.py as -D cflags"
#endif
#ifndef MAX_TEXT_RANGES
#define MAX_TEXT_RANGES 4
#endif
#ifndef MAX_TARGETS
#define MAX_TARGETS 64
#endif
#ifndef MAX_SYNC_THREADS
#define MAX_SYNC_THREADS 16384
#endif
#ifndef NCCL_DTYPES
#define NCCL_DTYPES 16
#endif
#ifndef STEP_EVENT_PAGES
#define STEP_EVENT_PAGES 64
#endif

struct pid_state_t {
    u64 counter[N_COUNTERS];
    // Executable mappings of this process's libcudart and libcuda: a launch
    // entry point whose caller lies in one was forwarded by the CUDA libraries.
    u64 text_lo[MAX_TEXT_RANGES];
    u64 text_hi[MAX_TEXT_RANGES];
};
BPF_HASH(pids, u32, struct pid_state_t, MAX_TARGETS);

struct sync_open_t {
    u64 t0_ns;  // bpf_ktime_get_ns at entry of the outermost blocking call
    u64 sp;     // user stack pointer at that entry (it points at the return address)
};
BPF_HASH(sync_open, u64, struct sync_open_t, MAX_SYNC_THREADS);  // key: pid_tgid

BPF_ARRAY(nccl_dtype_bytes, u32, NCCL_DTYPES);  // ncclDataType_t -> bytes (0: unknown)

static __always_inline struct pid_state_t *this_process(void)
{
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    return pids.lookup(&pid);
}

static __always_inline void add(struct pid_state_t *st, int id, u64 value)
{
    if (id >= 0 && id < N_COUNTERS)
        __sync_fetch_and_add(&st->counter[id], value);
}

// At a uprobe on a function's first instruction the stack pointer holds the
// return address (x86-64: pushed by `call`; nothing of the callee has run).
static __always_inline int called_from_cuda_library(struct pt_regs *ctx,
                                                    struct pid_state_t *st)
{
    u64 ret = 0;
    if (bpf_probe_read_user(&ret, sizeof(ret), (void *)PT_REGS_SP(ctx)) != 0)
        return 0;
#pragma unroll
    for (int i = 0; i < MAX_TEXT_RANGES; i++) {
        if (ret >= st->text_lo[i] && ret < st->text_hi[i])
            return 1;
    }
    return 0;
}

static __always_inline int count_launch(struct pt_regs *ctx, int direct, int forwarded)
{
    struct pid_state_t *st = this_process();
    if (!st)
        return 0;
    add(st, called_from_cuda_library(ctx, st) ? forwarded : direct, 1);
    return 0;
}

int on_runtime_launch(struct pt_regs *ctx)
{
    return count_launch(ctx, CTR_RUNTIME_LAUNCHES, CTR_FORWARDED_LAUNCHES);
}

int on_driver_launch(struct pt_regs *ctx)
{
    return count_launch(ctx, CTR_DRIVER_LAUNCHES, CTR_FORWARDED_LAUNCHES);
}

int on_graph_launch(struct pt_regs *ctx)
{
    return count_launch(ctx, CTR_GRAPH_LAUNCHES, CTR_FORWARDED_GRAPH_LAUNCHES);
}

// Entries and returns are matched by stack pointer rather than by a depth
// count, so that a return never seen (the call began between the attach of
// the entry probe and of the return probe, the thread was killed or longjmp'd
// out) cannot leave the thread looking "inside a call" for ever: the stack
// grows down, so a call made inside the one being timed enters with a lower
// stack pointer, and the timed call's own return comes back above its entry
// stack pointer (entry sp + 8, after `ret`), while a nested one's does not.
int on_sync_enter(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    struct pid_state_t *st = this_process();
    if (!st)
        return 0;
    u64 sp = PT_REGS_SP(ctx);
    // Only this thread touches its own entry, so no atomics are needed on it.
    struct sync_open_t *open = sync_open.lookup(&id);
    if (open && sp < open->sp)
        return 0;  // nested: the outer call's time covers it
    if (open)
        add(st, CTR_SYNC_UNTRACKED, 1);  // the earlier call's return was never seen
    struct sync_open_t fresh = {};
    fresh.t0_ns = bpf_ktime_get_ns();
    fresh.sp = sp;
    // A full table (MAX_SYNC_THREADS threads blocked at once) loses this wait.
    if (sync_open.update(&id, &fresh) != 0)
        add(st, CTR_SYNC_UNTRACKED, 1);
    return 0;
}

int on_sync_exit(struct pt_regs *ctx)
{
    u64 t = bpf_ktime_get_ns();
    u64 id = bpf_get_current_pid_tgid();
    struct sync_open_t *open = sync_open.lookup(&id);
    if (!open)
        return 0;  // entered before the probes were attached
    if (PT_REGS_SP(ctx) <= open->sp)
        return 0;  // a nested call returning
    u64 waited = t - open->t0_ns;
    sync_open.delete(&id);
    struct pid_state_t *st = this_process();
    if (!st)
        return 0;
    add(st, CTR_SYNC_CALLS, 1);
    add(st, CTR_SYNC_WAIT_NS, waited);
    return 0;
}

static __always_inline int count_nccl(int calls_id, int bytes_id, u64 count, u64 datatype)
{
    struct pid_state_t *st = this_process();
    if (!st)
        return 0;
    add(st, calls_id, 1);
    // ncclDataType_t is a C enum (int): only the low 32 bits of the register count.
    u32 dtype = (u32)datatype;
    u32 *size = nccl_dtype_bytes.lookup(&dtype);  // NULL beyond NCCL_DTYPES
    if (!size || *size == 0) {
        add(st, CTR_NCCL_UNKNOWN_DTYPE_CALLS, 1);
        return 0;
    }
    add(st, bytes_id, count * *size);
    return 0;
}

// One program per collective: the count and datatype sit in different
// argument registers (x86-64 SysV: PARM1..6 = rdi, rsi, rdx, rcx, r8, r9).
#define NCCL_PROBE(name, id, count_parm, dtype_parm)                             \
    int on_nccl_##name(struct pt_regs *ctx)                                      \
    {                                                                            \
        return count_nccl(CTR_NCCL_CALLS_##id, CTR_NCCL_BYTES_##id,              \
                          PT_REGS_PARM##count_parm(ctx),                         \
                          PT_REGS_PARM##dtype_parm(ctx));                        \
    }

// ncclAllReduce(sendbuff, recvbuff, count, datatype, op, comm, stream)
NCCL_PROBE(all_reduce, ALL_REDUCE, 3, 4)
// ncclReduceScatter(sendbuff, recvbuff, recvcount, datatype, op, comm, stream)
NCCL_PROBE(reduce_scatter, REDUCE_SCATTER, 3, 4)
// ncclAllGather(sendbuff, recvbuff, sendcount, datatype, comm, stream)
NCCL_PROBE(all_gather, ALL_GATHER, 3, 4)
// ncclBroadcast(sendbuff, recvbuff, count, datatype, root, comm, stream)
NCCL_PROBE(broadcast, BROADCAST, 3, 4)
// ncclReduce(sendbuff, recvbuff, count, datatype, op, root, comm, stream)
NCCL_PROBE(reduce, REDUCE, 3, 4)
// ncclSend(sendbuff, count, datatype, peer, comm, stream)
NCCL_PROBE(send, SEND, 2, 3)
// ncclRecv(recvbuff, count, datatype, peer, comm, stream)
NCCL_PROBE(recv, RECV, 2, 3)
// NCCL 2.28+: ncclAlltoAll(sendbuff, recvbuff, count, datatype, comm, stream)
NCCL_PROBE(all_to_all, ALL_TO_ALL, 3, 4)
// ncclGather(sendbuff, recvbuff, count, datatype, root, comm, stream)
NCCL_PROBE(gather, GATHER, 3, 4)
// ncclScatter(sendbuff, recvbuff, count, datatype, root, comm, stream)
NCCL_PROBE(scatter, SCATTER, 3, 4)
// The nccl*Config twins (NCCL 2.32) take the same arguments plus a trailing
// config pointer, so the same programs serve them.

// A snapshot of one process's counters at the entry of Optimizer.step, taken
// on the thread that calls it. Every call that thread made before the step is
// in it, and none it makes after. Counters of other threads are read word by
// word as they stand at that instant (each 8-byte load is atomic).
struct step_event_t {
    u64 t_mono_ns;  // bpf_ktime_get_ns (CLOCK_MONOTONIC) at the probe's first instruction
    u32 tgid;
    u32 _pad;
    u64 counter[N_COUNTERS];
};
BPF_RINGBUF_OUTPUT(step_events, STEP_EVENT_PAGES);
BPF_ARRAY(step_events_dropped, u64, 1);  // ring buffer full: counted, reported by user space

int on_record_function_enter(struct pt_regs *ctx)
{
    u64 t = bpf_ktime_get_ns();  // first, as iterations.bpf.c does: the same instant
    struct pid_state_t *st = this_process();
    if (!st)
        return 0;
    u64 head[PREFIX_WORDS] = {};
    if (!read_step_name_head(ctx, head))
        return 0;
    int zero = 0;
    if (classify(prefixes.lookup(&zero), head) != STEP_KIND_OPTIMIZER_STEP)
        return 0;
    struct step_event_t *ev = step_events.ringbuf_reserve(sizeof(struct step_event_t));
    if (!ev) {
        u64 *n = step_events_dropped.lookup(&zero);
        if (n)
            __sync_fetch_and_add(n, 1);
        return 0;
    }
    ev->t_mono_ns = t;
    ev->tgid = bpf_get_current_pid_tgid() >> 32;
    ev->_pad = 0;
    __builtin_memcpy(ev->counter, st->counter, sizeof(ev->counter));
    step_events.ringbuf_submit(ev, 0);
    return 0;
}
