// Training-step names of PyTorch's record_function, recognised in the kernel.
// Shared by iterations.bpf.c (step markers) and cuda.bpf.c (counter snapshots
// at Optimizer.step), which include it with -I<this folder>; user space fills
// the table (perfmon.probes.uprobes, when it loads the program).
//
// record_function_enter_new(const std::string& name, const std::optional<std::string>& args)
// returns a class by value, so the hidden return slot takes the first argument
// register and the name's std::string* is the SECOND argument. libstdc++ keeps
// the std::string's char* at offset 0.
//
// bcc 0.26 rewrites map calls (`table.lookup(...)`) in the main file only and
// compiles included files as they are, so nothing here touches a map: the
// including program looks the table up itself and passes it to classify().
//
// Settings arrive as -D cflags (made by perfmon.probes.uprobes):
// PREFIX_WORDS and MAX_PREFIXES (size of the table) and STEP_KIND_OPTIMIZER_STEP
// (the kind user space gives "Optimizer.step#").

#ifndef STEP_NAMES_BPF_H
#define STEP_NAMES_BPF_H

#ifndef PREFIX_WORDS
#define PREFIX_WORDS 3
#endif
#ifndef MAX_PREFIXES
#define MAX_PREFIXES 4
#endif
#ifndef STEP_KIND_OPTIMIZER_STEP
#error "STEP_KIND_OPTIMIZER_STEP comes from the cflags perfmon.probes.uprobes gives"
#endif

// Name prefixes that mark a step, filled by user space: each is up to
// PREFIX_WORDS little-endian 8-byte words with a mask for the last partial
// word, and the kind it marks (0: unused slot). String literals would land in
// .rodata, which bcc 0.26 cannot load. All prefixes sit in the one entry of
// `prefixes`, so a classification costs one map lookup.
struct prefix_t {
    u64 word[PREFIX_WORDS];
    u64 mask[PREFIX_WORDS];
    u32 kind;
    u32 _pad;
};
struct step_prefixes_t {
    struct prefix_t entry[MAX_PREFIXES];
};
BPF_ARRAY(prefixes, struct step_prefixes_t, 1);

// Reads the first PREFIX_WORDS * 8 bytes of the record_function name into
// `head` (zero-padded); returns the name's char* (user memory), or 0 when it
// cannot be read.
static __always_inline const char *read_step_name_head(struct pt_regs *ctx, u64 *head)
{
    const void *str = (const void *)PT_REGS_PARM2(ctx);
    const char *data = 0;
    if (bpf_probe_read_user(&data, sizeof(data), str) != 0)
        return 0;
    if (bpf_probe_read_user(head, PREFIX_WORDS * sizeof(u64), data) != 0) {
        // A name shorter than the head can end right at a page edge; retry as a string.
        if (bpf_probe_read_user_str(head, PREFIX_WORDS * sizeof(u64), data) <= 0)
            return 0;
    }
    return data;
}

// The kind of the first prefix that `head` starts with, or 0 (also when the
// table is missing).
static __always_inline u32 classify(const struct step_prefixes_t *table, const u64 *head)
{
    if (!table)
        return 0;
#pragma unroll
    for (int i = 0; i < MAX_PREFIXES; i++) {
        const struct prefix_t *p = &table->entry[i];
        if (!p->kind)
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

#endif  // STEP_NAMES_BPF_H
