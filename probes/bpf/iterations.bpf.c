// Iteration boundaries inside a PyTorch process, from uprobes in libtorch_cpu.so.
//
// Only the few record_function names that mark a training step leave the
// kernel; every other record_function call returns after one short compare
// (step_names.bpf.h reads and classifies the name). Engine::execute (one call
// per backward()) is counted at entry and exit, and so are the c10d calls that block
// on a collective (the wait_* events).
//
// Settings arrive as -D cflags: NAME_LEN (bytes of the name copied out),
// RING_PAGES (the ring buffer's size), and those of step_names.bpf.h.

#include <uapi/linux/ptrace.h>

#include "step_names.bpf.h"

#ifndef NAME_LEN
#define NAME_LEN 64
#endif

enum event_kind {
    EV_OPTIMIZER_STEP = 1,
    EV_ZERO_GRAD = 2,
    EV_DATALOADER_NEXT = 3,
    EV_BACKWARD_ENTER = 4,
    EV_BACKWARD_EXIT = 5,
    EV_WAIT_ENTER = 6,
    EV_WAIT_EXIT = 7,
};

struct event_t {
    u64 t_mono_ns;      // bpf_ktime_get_ns: CLOCK_MONOTONIC
    u32 pid;            // tgid
    u32 tid;
    u32 kind;
    u32 _pad;
    char name[NAME_LEN];
};

#ifndef RING_PAGES
#define RING_PAGES 64
#endif
BPF_RINGBUF_OUTPUT(events, RING_PAGES);  // a power of two pages
BPF_ARRAY(dropped, u64, 1);              // ring buffer full: counted, reported by user space
BPF_PERCPU_ARRAY(scratch, struct event_t, 1);

static __always_inline void emit(struct event_t *ev)
{
    if (events.ringbuf_output(ev, sizeof(*ev), 0) != 0) {
        int zero = 0;
        u64 *n = dropped.lookup(&zero);
        if (n)
            __sync_fetch_and_add(n, 1);
    }
}

static __always_inline struct event_t *fresh_event(u32 kind)
{
    int zero = 0;
    struct event_t *ev = scratch.lookup(&zero);
    if (!ev)
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    ev->t_mono_ns = bpf_ktime_get_ns();
    ev->pid = id >> 32;
    ev->tid = (u32)id;
    ev->kind = kind;
    ev->_pad = 0;
    return ev;
}

int on_record_function_enter(struct pt_regs *ctx)
{
    u64 t = bpf_ktime_get_ns();
    u64 head[PREFIX_WORDS] = {};
    const char *data = read_step_name_head(ctx, head);
    if (!data)
        return 0;
    int zero = 0;
    u32 kind = classify(prefixes.lookup(&zero), head);
    if (!kind)
        return 0;
    struct event_t *ev = fresh_event(kind);
    if (!ev)
        return 0;
    ev->t_mono_ns = t;
    bpf_probe_read_user_str(&ev->name, sizeof(ev->name), data);
    emit(ev);
    return 0;
}

static __always_inline int emit_unnamed(u32 kind)
{
    struct event_t *ev = fresh_event(kind);
    if (ev) {
        ev->name[0] = 0;
        emit(ev);
    }
    return 0;
}

int on_backward_enter(struct pt_regs *ctx)
{
    return emit_unnamed(EV_BACKWARD_ENTER);
}

int on_backward_exit(struct pt_regs *ctx)
{
    return emit_unnamed(EV_BACKWARD_EXIT);
}

// A thread blocked on a collective (c10d Work::wait, DDP's Reducer::finalize_backward):
// a few per step, so each entry and return leaves the kernel.
int on_wait_enter(struct pt_regs *ctx)
{
    return emit_unnamed(EV_WAIT_ENTER);
}

int on_wait_exit(struct pt_regs *ctx)
{
    return emit_unnamed(EV_WAIT_EXIT);
}
