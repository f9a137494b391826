// Iteration boundaries inside a PyTorch process, from uprobes in libtorch_cpu.so.
//
// record_function_enter_new(const std::string& name, const std::optional<std::string>& args)
// returns a class by value, so the hidden return slot takes the first argument
// register and the name's std::string* is the SECOND argument. libstdc++ keeps
// the std::string's char* at offset 0.
//
// Only the few record_function names that mark a training step leave the
// kernel; every other record_function call returns after one short compare.
// Engine::execute (one call per backward()) is counted at entry and exit.
//
// Settings arrive as -D cflags: NAME_LEN (bytes of the name copied out),
// PREFIX_WORDS and MAX_PREFIXES (size of the prefix table).

#include <uapi/linux/ptrace.h>

#ifndef NAME_LEN
#define NAME_LEN 64
#endif
#ifndef PREFIX_WORDS
#define PREFIX_WORDS 3
#endif
#ifndef MAX_PREFIXES
#define MAX_PREFIXES 4
#endif

enum event_kind {
    EV_OPTIMIZER_STEP = 1,
    EV_ZERO_GRAD = 2,
    EV_DATALOADER_NEXT = 3,
    EV_BACKWARD_ENTER = 4,
    EV_BACKWARD_EXIT = 5,
};

struct event_t {
    u64 t_mono_ns;      // bpf_ktime_get_ns: CLOCK_MONOTONIC
    u32 pid;            // tgid
    u32 tid;
    u32 kind;
    u32 _pad;
    char name[NAME_LEN];
};

BPF_RINGBUF_OUTPUT(events, 64);          // 64 pages
BPF_ARRAY(dropped, u64, 1);              // ring buffer full: counted, reported by user space
BPF_PERCPU_ARRAY(scratch, struct event_t, 1);

// Name prefixes that mark a step, filled by user space: each is up to
// PREFIX_WORDS little-endian 8-byte words with a mask for the last partial
// word. (String literals would land in .rodata, which this bcc cannot load.)
struct prefix_t {
    u64 word[PREFIX_WORDS];
    u64 mask[PREFIX_WORDS];
    u32 kind;
    u32 _pad;
};
BPF_ARRAY(prefixes, struct prefix_t, MAX_PREFIXES);

static __always_inline u32 classify(const u64 *head)
{
#pragma unroll
    for (int i = 0; i < MAX_PREFIXES; i++) {
        int idx = i;
        struct prefix_t *p = prefixes.lookup(&idx);
        if (!p || !p->kind)
            continue;
        int match = 1;
#pragma unroll
        for (int w = 0; w < PREFIX_WORDS; w++) {
            if ((head[w] & p->mask[w]) != p->word[w])
                match = 0;
        }
        if (match)
            return p->kind;
    }
    return 0;
}

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
    const void *str = (const void *)PT_REGS_PARM2(ctx);
    const char *data = 0;
    if (bpf_probe_read_user(&data, sizeof(data), str) != 0)
        return 0;
    u64 head[PREFIX_WORDS] = {};
    if (bpf_probe_read_user(&head, sizeof(head), data) != 0) {
        // A name shorter than the head can end right at a page edge; retry as a string.
        if (bpf_probe_read_user_str(&head, sizeof(head), data) <= 0)
            return 0;
    }
    u32 kind = classify(head);
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

int on_backward_enter(struct pt_regs *ctx)
{
    struct event_t *ev = fresh_event(EV_BACKWARD_ENTER);
    if (!ev)
        return 0;
    ev->name[0] = 0;
    emit(ev);
    return 0;
}

int on_backward_exit(struct pt_regs *ctx)
{
    struct event_t *ev = fresh_event(EV_BACKWARD_EXIT);
    if (!ev)
        return 0;
    ev->name[0] = 0;
    emit(ev);
    return 0;
}
