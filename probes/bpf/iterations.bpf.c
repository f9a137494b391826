// Iteration boundaries inside a PyTorch process, from uprobes in libtorch_cpu.so.
//
// Only the few record_function names that mark a training step leave the
// kernel; every other record_function call returns after one short compare
// (step_names.bpf.h reads and classifies the name). Engine::execute (one call
// per backward()) is counted at entry and exit.
//
// The c10d calls that block on the process group (the work objects' wait: Work::wait
// and every override of it, DDP's finalize_backward) are accounted here, not sent
// out: a tensor-parallel job makes hundreds a step. Each thread's wait (nested calls
// once) is added to its process's running total when it returns, and every
// Optimizer.step event carries the totals (wait_ns, waits); the thread stepping the
// optimizer is in no wait (a wait whose return was lost ends there). A wait on a
// point-to-point send or receive (a pipeline's activations and gradients: the
// on_p2p_wait_* probes) is in those totals and, besides, in the p2p ones (p2p_wait_ns,
// p2p_waits): the outermost call of a thread's nest says which. With raw_waits[0] set
// (asked for, or a hang or a fail-slow window) each entry and return also leaves the
// kernel as a wait_* (p2p_wait_*) event, stamped with the same time the totals use.
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
    EV_GRAD_READ = 8,
    EV_P2P_WAIT_ENTER = 9,
    EV_P2P_WAIT_EXIT = 10,
};

struct event_t {
    u64 t_mono_ns;      // bpf_ktime_get_ns: CLOCK_MONOTONIC
    u32 pid;            // tgid
    u32 tid;
    u32 kind;
    u32 _pad;
    u64 wait_ns;        // EV_OPTIMIZER_STEP: the process's waits so far (total, count)
    u64 waits;
    u64 p2p_wait_ns;    // ... of which on point-to-point sends and receives
    u64 p2p_waits;
    char name[NAME_LEN];
};

struct wait_thread {
    u32 depth;          // nested waits open
    u32 p2p;            // 1: the outermost is a point-to-point send's or receive's
    u64 since;          // when the outermost began
};

struct wait_total {
    u64 ns;             // added by every thread of the process: atomics
    u64 count;
    u64 p2p_ns;         // ... the point-to-point ones among them
    u64 p2p_count;
};

#ifndef RING_PAGES
#define RING_PAGES 64
#endif
BPF_RINGBUF_OUTPUT(events, RING_PAGES);  // a power of two pages
BPF_ARRAY(dropped, u64, 1);              // ring buffer full: counted, reported by user space
BPF_PERCPU_ARRAY(scratch, struct event_t, 1);
// Only a thread itself touches its entry; a training process has a few dozen threads.
BPF_HASH(wait_threads, u32, struct wait_thread, 65536);
BPF_HASH(wait_totals, u32, struct wait_total, 4096);  // tgid
BPF_ARRAY(raw_waits, u32, 1);                        // 1: wait_* events leave the kernel

// Where a job steps its parameters without torch.optim's marker (a compiled optimizer
// step, a hand-written update): the first read of a gradient after a backward pass,
// outside every backward pass of the process, is its update. Reads inside backward()
// (hooks, DDP's reducer) and the update's own later reads leave nothing: one event an
// update leaves the kernel, however many parameters it reads.
struct update_state {
    s64 open;           // backward passes running in the process (any thread, nested)
    u64 pending;        // 1: a backward pass ended since the last update's first read
};
BPF_HASH(updates, u32, struct update_state, 4096);  // tgid

// ``size``: the whole event, or its head alone (up to its name) for an event with no
// name: a tensor-parallel job's raw waits fill the ring half as fast.
static __always_inline void emit(struct event_t *ev, u64 size)
{
    if (events.ringbuf_output(ev, size, 0) != 0) {
        int zero = 0;
        u64 *n = dropped.lookup(&zero);
        if (n)
            __sync_fetch_and_add(n, 1);
    }
}

static __always_inline struct event_t *fresh_event(u32 kind, u64 t)
{
    int zero = 0;
    struct event_t *ev = scratch.lookup(&zero);
    if (!ev)
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    ev->t_mono_ns = t;
    ev->pid = id >> 32;
    ev->tid = (u32)id;
    ev->kind = kind;
    ev->_pad = 0;
    ev->wait_ns = 0;
    ev->waits = 0;
    ev->p2p_wait_ns = 0;
    ev->p2p_waits = 0;
    return ev;
}

static __always_inline void add_wait(u32 pid, u64 ns, u32 p2p)
{
    struct wait_total zero = {};
    struct wait_total *total = wait_totals.lookup_or_try_init(&pid, &zero);
    if (total) {
        __sync_fetch_and_add(&total->ns, ns);
        __sync_fetch_and_add(&total->count, 1);
        if (p2p) {
            __sync_fetch_and_add(&total->p2p_ns, ns);
            __sync_fetch_and_add(&total->p2p_count, 1);
        }
    }
}

// The stepping thread's open wait ends at the step; the event gets the totals.
static __always_inline void step_waits(struct event_t *ev)
{
    u32 tid = ev->tid, pid = ev->pid;
    struct wait_thread *w = wait_threads.lookup(&tid);
    if (w && w->depth) {
        w->depth = 0;
        add_wait(pid, ev->t_mono_ns - w->since, w->p2p);
    }
    struct wait_total *total = wait_totals.lookup(&pid);
    if (total) {
        ev->wait_ns = total->ns;
        ev->waits = total->count;
        ev->p2p_wait_ns = total->p2p_ns;
        ev->p2p_waits = total->p2p_count;
    }
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
    struct event_t *ev = fresh_event(kind, t);
    if (!ev)
        return 0;
    if (kind == EV_OPTIMIZER_STEP)
        step_waits(ev);
    bpf_probe_read_user_str(&ev->name, sizeof(ev->name), data);
    emit(ev, sizeof(*ev));
    return 0;
}

static __always_inline int emit_unnamed(u32 kind, u64 t)
{
    struct event_t *ev = fresh_event(kind, t);
    if (ev) {
        emit(ev, __builtin_offsetof(struct event_t, name));
    }
    return 0;
}

static __always_inline int raw_waits_on(void)
{
    int zero = 0;
    u32 *on = raw_waits.lookup(&zero);
    return on && *on;
}

int on_backward_enter(struct pt_regs *ctx)
{
    u64 t = bpf_ktime_get_ns();
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    struct update_state zero = {};
    struct update_state *st = updates.lookup_or_try_init(&pid, &zero);
    if (st) {
        __sync_fetch_and_add(&st->open, 1);
        st->pending = 1;
    }
    return emit_unnamed(EV_BACKWARD_ENTER, t);
}

int on_backward_exit(struct pt_regs *ctx)
{
    u64 t = bpf_ktime_get_ns();
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    struct update_state *st = updates.lookup(&pid);
    // (a pass entered before the probes were attached has no entry counted)
    if (st && st->open > 0)
        __sync_fetch_and_add(&st->open, -1);
    return emit_unnamed(EV_BACKWARD_EXIT, t);
}

int on_grad_read(struct pt_regs *ctx)
{
    u64 t = bpf_ktime_get_ns();
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    struct update_state *st = updates.lookup(&pid);
    if (!st || !st->pending || st->open > 0)
        return 0;
    // Two threads reading at once may both emit: user space ends one update of them.
    st->pending = 0;
    struct event_t *ev = fresh_event(EV_GRAD_READ, t);
    if (!ev)
        return 0;
    step_waits(ev);
    emit(ev, __builtin_offsetof(struct event_t, name));
    return 0;
}

// A thread blocked on its process group: a collective's work (c10d Work::wait and its
// overrides, DDP's Reducer::finalize_backward), or a point-to-point send's or
// receive's (p2p).
static __always_inline int wait_enter(u32 p2p)
{
    u64 t = bpf_ktime_get_ns();
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct wait_thread zero = {};
    struct wait_thread *w = wait_threads.lookup_or_try_init(&tid, &zero);
    if (w) {
        if (w->depth == 0) {
            w->since = t;
            w->p2p = p2p;
        }
        w->depth += 1;
    }
    return raw_waits_on() ? emit_unnamed(p2p ? EV_P2P_WAIT_ENTER : EV_WAIT_ENTER, t) : 0;
}

static __always_inline int wait_exit(u32 p2p)
{
    u64 t = bpf_ktime_get_ns();
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    struct wait_thread *w = wait_threads.lookup(&tid);
    if (w && w->depth) {  // else entered before the probes were attached
        w->depth -= 1;
        if (w->depth == 0)
            add_wait(id >> 32, t - w->since, w->p2p);
    }
    return raw_waits_on() ? emit_unnamed(p2p ? EV_P2P_WAIT_EXIT : EV_WAIT_EXIT, t) : 0;
}

int on_wait_enter(struct pt_regs *ctx) { return wait_enter(0); }
int on_wait_exit(struct pt_regs *ctx) { return wait_exit(0); }
int on_p2p_wait_enter(struct pt_regs *ctx) { return wait_enter(1); }
int on_p2p_wait_exit(struct pt_regs *ctx) { return wait_exit(1); }
