/*
 * A fake libnvidia-ml.so.1 for tests on hosts without an NVIDIA GPU.
 *
 * The real nvidia-ml-py (module pynvml) loads it with CDLL("libnvidia-ml.so.1")
 * when its directory is first on LD_LIBRARY_PATH, so the code under test runs
 * unchanged down to the C ABI. Signatures and struct layouts follow nvml.h
 * (CUDA 12.x) as mirrored by pynvml.py; only the functions perfmon calls exist,
 * so anything else fails in pynvml with NVML_ERROR_FUNCTION_NOT_FOUND, as an old
 * driver would.
 *
 * Scenario: the file named by $FAKE_NVML_SCENARIO (no variable or no file: one
 * healthy GPU). One `key=value` per line, `#` starts a comment, integers may be
 * hex (0x...). It is re-read whenever its mtime, size or inode changes, so a
 * test can rewrite it (atomically: write + rename) while a session runs. Call
 * counters, lost GPUs and delivered XIDs are kept across re-reads and cleared
 * by the first nvmlInit.
 *
 *   count=2                                 number of GPUs (default 1)
 *   driver_version=550.54.15  nvml_version=12.550.54.15  cuda_driver_version=12040
 *   func.<nvmlFunction>=<ERROR>             that call returns NVML_ERROR_<ERROR>
 *                                           (e.g. func.nvmlInitWithFlags=DRIVER_NOT_LOADED)
 *   gpuN.func.<nvmlFunction>=<ERROR>        the same, for GPU N only
 *   gpuN.name= gpuN.uuid= gpuN.pci_bus_id=
 *   gpuN.utilization_gpu_pct= gpuN.utilization_memory_pct=
 *   gpuN.memory_total_bytes= gpuN.memory_used_bytes=
 *   gpuN.power_mw= gpuN.power_limit_mw= gpuN.power_default_limit_mw=
 *   gpuN.sm_clock_mhz= gpuN.mem_clock_mhz=
 *   gpuN.temperature_c= gpuN.temperature_slowdown_c= gpuN.temperature_shutdown_c=
 *   gpuN.temperature_gpu_max_c= gpuN.temperature_mem_max_c=
 *   gpuN.clocks_event_reasons=0x40          bitmask, nvmlClocksEventReason*
 *   gpuN.ecc.volatile.corrected= gpuN.ecc.volatile.uncorrected=
 *   gpuN.ecc.aggregate.corrected= gpuN.ecc.aggregate.uncorrected=
 *   gpuN.retired_pages_pending=0|1
 *   gpuN.remap.corrected= .uncorrected= .pending=0|1 .failure=0|1
 *   gpuN.pcie.width= gpuN.pcie.width_max= gpuN.pcie.gen= gpuN.pcie.gen_max=
 *   gpuN.nvlink.count=18                    links 0..count-1 exist (0: NOT_SUPPORTED)
 *   gpuN.nvlink.inactive=3,7                links reported inactive
 *   gpuN.proc.<pid>.used_bytes=<n|NA>       compute processes (NA: not available)
 *   gpuN.xid=79,48                          XIDs raised, in order, once an event set
 *                                           is registered for GPU N; each delivered once
 *   gpuN.lost=1                             every call on GPU N returns GPU_IS_LOST
 *   gpuN.lost_after_calls=K                 ... after K successful calls on GPU N
 *   gpuN.gpm=1                              GPM supported (default 0)
 *   gpuN.gpm.<metricId>=<double>            value of an nvmlGpmMetricId_t (default 0)
 *
 * Built by tests/fakes/build.py: gcc -shared -fPIC -Wl,-soname,libnvidia-ml.so.1.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

typedef int nvmlReturn_t;
#define OK 0
#define E_UNINITIALIZED 1
#define E_INVALID_ARGUMENT 2
#define E_NOT_SUPPORTED 3
#define E_INSUFFICIENT_SIZE 7
#define E_TIMEOUT 10
#define E_GPU_IS_LOST 15
#define E_ARGUMENT_VERSION_MISMATCH 25

#define MAX_GPUS 16
#define MAX_ENTRIES 1024
#define XID_EVENT 0x8ULL /* nvmlEventTypeXidCriticalError */

typedef struct fake_device { int index; } *nvmlDevice_t;
typedef struct { unsigned long long mask[MAX_GPUS]; } *nvmlEventSet_t;
typedef struct { int gpu; int taken; } *nvmlGpmSample_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;
typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;
typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType, eventData;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlEventData_t;
typedef struct { unsigned int version, isSupportedDevice; } nvmlGpmSupport_t;
typedef struct {
    unsigned int metricId;
    nvmlReturn_t nvmlReturn;
    double value;
    struct { const char *shortName, *longName, *unit; } metricInfo;
} nvmlGpmMetric_t;
typedef struct {
    unsigned int version, numMetrics;
    nvmlGpmSample_t sample1, sample2;
    nvmlGpmMetric_t metrics[]; /* NVML_GPM_METRIC_MAX in nvml.h; we touch numMetrics */
} nvmlGpmMetricsGet_t;

static const struct { const char *name; int code; } ERRORS[] = {
    {"UNINITIALIZED", 1}, {"INVALID_ARGUMENT", 2}, {"NOT_SUPPORTED", 3},
    {"NO_PERMISSION", 4}, {"ALREADY_INITIALIZED", 5}, {"NOT_FOUND", 6},
    {"INSUFFICIENT_SIZE", 7}, {"INSUFFICIENT_POWER", 8}, {"DRIVER_NOT_LOADED", 9},
    {"TIMEOUT", 10}, {"IRQ_ISSUE", 11}, {"LIBRARY_NOT_FOUND", 12},
    {"FUNCTION_NOT_FOUND", 13}, {"CORRUPTED_INFOROM", 14}, {"GPU_IS_LOST", 15},
    {"RESET_REQUIRED", 16}, {"OPERATING_SYSTEM", 17}, {"LIB_RM_VERSION_MISMATCH", 18},
    {"IN_USE", 19}, {"MEMORY", 20}, {"NO_DATA", 21}, {"UNKNOWN", 999},
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static char keys[MAX_ENTRIES][128], vals[MAX_ENTRIES][256];
static int n_entries;
static struct stat loaded_st;
static int loaded_any;
static int init_count;
static const char *cur_fn; /* name of the API call in progress (under mu) */
static struct fake_device devices[MAX_GPUS];
static long long calls[MAX_GPUS];
static int lost[MAX_GPUS];
static int xids_delivered[MAX_GPUS];

static char *trim(char *s) {
    while (*s == ' ' || *s == '\t') s++;
    char *e = s + strlen(s);
    while (e > s && (e[-1] == ' ' || e[-1] == '\t' || e[-1] == '\n' || e[-1] == '\r')) *--e = 0;
    return s;
}

/* Re-read the scenario when the file changed (by mtime, size or inode). */
static void reload(void) {
    const char *path = getenv("FAKE_NVML_SCENARIO");
    struct stat st;
    if (!path || stat(path, &st) != 0) {
        n_entries = 0;
        loaded_any = 0;
        return;
    }
    if (loaded_any && st.st_mtim.tv_sec == loaded_st.st_mtim.tv_sec &&
        st.st_mtim.tv_nsec == loaded_st.st_mtim.tv_nsec && st.st_size == loaded_st.st_size &&
        st.st_ino == loaded_st.st_ino)
        return;
    FILE *f = fopen(path, "r");
    if (!f) return;
    char line[512];
    n_entries = 0;
    while (fgets(line, sizeof line, f) && n_entries < MAX_ENTRIES) {
        char *hash = strchr(line, '#');
        if (hash) *hash = 0;
        char *eq = strchr(line, '=');
        if (!eq) continue;
        *eq = 0;
        snprintf(keys[n_entries], sizeof keys[0], "%s", trim(line));
        snprintf(vals[n_entries], sizeof vals[0], "%s", trim(eq + 1));
        n_entries++;
    }
    fclose(f);
    loaded_st = st;
    loaded_any = 1;
}

static const char *sv(const char *key) {
    for (int i = n_entries - 1; i >= 0; i--) /* last one wins */
        if (strcmp(keys[i], key) == 0) return vals[i];
    return NULL;
}

static const char *gv(int g, const char *suffix) {
    char key[256];
    snprintf(key, sizeof key, "gpu%d.%s", g, suffix);
    return sv(key);
}

static long long gi(int g, const char *suffix, long long dflt) {
    const char *v = gv(g, suffix);
    return v ? strtoll(v, NULL, 0) : dflt;
}

static int error_code(const char *name) {
    for (size_t i = 0; i < sizeof ERRORS / sizeof ERRORS[0]; i++)
        if (strcmp(ERRORS[i].name, name) == 0) return ERRORS[i].code;
    int code = atoi(name);
    return code ? code : 999;
}

static int gpu_count(void) {
    const char *v = sv("count");
    int n = v ? atoi(v) : 1;
    return n < 0 ? 0 : n > MAX_GPUS ? MAX_GPUS : n;
}

/* Checks a device handle, per-GPU overrides and the lost state; counts the call. */
static nvmlReturn_t dev_enter(nvmlDevice_t d, int *g) {
    if (!d || d < devices || d >= devices + MAX_GPUS || d->index >= gpu_count())
        return E_INVALID_ARGUMENT;
    *g = d->index;
    char key[128];
    snprintf(key, sizeof key, "func.%s", cur_fn);
    const char *override = gv(*g, key);
    if (override) return error_code(override);
    long long after = gi(*g, "lost_after_calls", -1);
    if (gi(*g, "lost", 0) || (after >= 0 && calls[*g] >= after)) lost[*g] = 1;
    if (lost[*g]) return E_GPU_IS_LOST;
    calls[*g]++;
    return OK;
}

#define DEV(d)                                      \
    int g;                                          \
    do {                                            \
        nvmlReturn_t e_ = dev_enter((d), &g);       \
        if (e_ != OK) return e_;                    \
    } while (0)

static nvmlReturn_t api_enter(const char *name, int needs_init) {
    reload();
    cur_fn = name;
    char key[128];
    snprintf(key, sizeof key, "func.%s", name);
    const char *override = sv(key);
    if (override) return error_code(override);
    if (needs_init && init_count == 0) return E_UNINITIALIZED;
    return OK;
}

/* Every API function takes the lock, applies overrides, then runs its body. */
#define API(name, needs_init, params, args)                      \
    static nvmlReturn_t name##_body params;                      \
    nvmlReturn_t name params {                                   \
        pthread_mutex_lock(&mu);                                 \
        nvmlReturn_t r = api_enter(#name, needs_init);           \
        if (r == OK) r = name##_body args;                       \
        pthread_mutex_unlock(&mu);                               \
        return r;                                                \
    }                                                            \
    static nvmlReturn_t name##_body params

static nvmlReturn_t copy_str(char *dst, unsigned int len, const char *src) {
    if (!dst) return E_INVALID_ARGUMENT;
    if (strlen(src) + 1 > len) return E_INSUFFICIENT_SIZE;
    strcpy(dst, src);
    return OK;
}

static nvmlReturn_t put_uint(unsigned int *out, long long value) {
    if (!out) return E_INVALID_ARGUMENT;
    *out = (unsigned int)value;
    return OK;
}

static nvmlReturn_t do_init(void) {
    if (init_count++ == 0) {
        memset(calls, 0, sizeof calls);
        memset(lost, 0, sizeof lost);
        memset(xids_delivered, 0, sizeof xids_delivered);
        for (int i = 0; i < MAX_GPUS; i++) devices[i].index = i;
    }
    return OK;
}

API(nvmlInit_v2, 0, (void), ()) { return do_init(); }
API(nvmlInitWithFlags, 0, (unsigned int flags), (flags)) { (void)flags; return do_init(); }
API(nvmlShutdown, 1, (void), ()) {
    init_count--;
    return OK;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    for (size_t i = 0; i < sizeof ERRORS / sizeof ERRORS[0]; i++)
        if (ERRORS[i].code == result) return ERRORS[i].name;
    return result == OK ? "SUCCESS" : "UNKNOWN";
}

API(nvmlSystemGetDriverVersion, 1, (char *v, unsigned int len), (v, len)) {
    const char *s = sv("driver_version");
    return copy_str(v, len, s ? s : "550.54.15");
}
API(nvmlSystemGetNVMLVersion, 1, (char *v, unsigned int len), (v, len)) {
    const char *s = sv("nvml_version");
    return copy_str(v, len, s ? s : "12.550.54.15");
}
API(nvmlSystemGetCudaDriverVersion, 1, (int *v), (v)) {
    const char *s = sv("cuda_driver_version");
    if (!v) return E_INVALID_ARGUMENT;
    *v = s ? atoi(s) : 12040;
    return OK;
}
API(nvmlDeviceGetCount_v2, 1, (unsigned int *n), (n)) { return put_uint(n, gpu_count()); }

API(nvmlDeviceGetHandleByIndex_v2, 1, (unsigned int i, nvmlDevice_t *d), (i, d)) {
    if (!d || i >= (unsigned int)gpu_count()) return E_INVALID_ARGUMENT;
    if (lost[i] || gi((int)i, "lost", 0)) return E_GPU_IS_LOST;
    *d = &devices[i];
    return OK;
}

API(nvmlDeviceGetName, 1, (nvmlDevice_t d, char *v, unsigned int len), (d, v, len)) {
    DEV(d);
    const char *s = gv(g, "name");
    return copy_str(v, len, s ? s : "NVIDIA H100 80GB HBM3");
}
API(nvmlDeviceGetUUID, 1, (nvmlDevice_t d, char *v, unsigned int len), (d, v, len)) {
    DEV(d);
    char dflt[64];
    snprintf(dflt, sizeof dflt, "GPU-fa4e0000-0000-0000-0000-%012d", g);
    const char *s = gv(g, "uuid");
    return copy_str(v, len, s ? s : dflt);
}
API(nvmlDeviceGetPciInfo_v3, 1, (nvmlDevice_t d, nvmlPciInfo_t *p), (d, p)) {
    DEV(d);
    if (!p) return E_INVALID_ARGUMENT;
    memset(p, 0, sizeof *p);
    const char *s = gv(g, "pci_bus_id");
    p->bus = 0x18 + g;
    p->pciDeviceId = 0x233010de;
    snprintf(p->busId, sizeof p->busId, "%s", s ? s : "");
    if (!s) snprintf(p->busId, sizeof p->busId, "00000000:%02X:00.0", p->bus);
    snprintf(p->busIdLegacy, sizeof p->busIdLegacy, "%.15s", p->busId + 4);
    return OK;
}
API(nvmlDeviceGetUtilizationRates, 1, (nvmlDevice_t d, nvmlUtilization_t *u), (d, u)) {
    DEV(d);
    if (!u) return E_INVALID_ARGUMENT;
    u->gpu = (unsigned int)gi(g, "utilization_gpu_pct", 0);
    u->memory = (unsigned int)gi(g, "utilization_memory_pct", 0);
    return OK;
}
API(nvmlDeviceGetMemoryInfo, 1, (nvmlDevice_t d, nvmlMemory_t *m), (d, m)) {
    DEV(d);
    if (!m) return E_INVALID_ARGUMENT;
    m->total = (unsigned long long)gi(g, "memory_total_bytes", 85520809984LL);
    m->used = (unsigned long long)gi(g, "memory_used_bytes", 567279616LL);
    m->free = m->total > m->used ? m->total - m->used : 0;
    return OK;
}
API(nvmlDeviceGetPowerUsage, 1, (nvmlDevice_t d, unsigned int *v), (d, v)) {
    DEV(d);
    return put_uint(v, gi(g, "power_mw", 72000));
}
API(nvmlDeviceGetEnforcedPowerLimit, 1, (nvmlDevice_t d, unsigned int *v), (d, v)) {
    DEV(d);
    return put_uint(v, gi(g, "power_limit_mw", 700000));
}
API(nvmlDeviceGetPowerManagementLimit, 1, (nvmlDevice_t d, unsigned int *v), (d, v)) {
    DEV(d);
    return put_uint(v, gi(g, "power_limit_mw", 700000));
}
API(nvmlDeviceGetPowerManagementDefaultLimit, 1, (nvmlDevice_t d, unsigned int *v), (d, v)) {
    DEV(d);
    return put_uint(v, gi(g, "power_default_limit_mw", 700000));
}
API(nvmlDeviceGetClockInfo, 1, (nvmlDevice_t d, int type, unsigned int *v), (d, type, v)) {
    DEV(d);
    if (type == 1) return put_uint(v, gi(g, "sm_clock_mhz", 1980)); /* NVML_CLOCK_SM */
    if (type == 2) return put_uint(v, gi(g, "mem_clock_mhz", 2619)); /* NVML_CLOCK_MEM */
    return E_NOT_SUPPORTED;
}
API(nvmlDeviceGetTemperature, 1, (nvmlDevice_t d, int sensor, unsigned int *v), (d, sensor, v)) {
    DEV(d);
    if (sensor != 0) return E_INVALID_ARGUMENT; /* only NVML_TEMPERATURE_GPU */
    return put_uint(v, gi(g, "temperature_c", 41));
}
typedef struct { unsigned int version; int sensorType; int temperature; } nvmlTemperature_t;
API(nvmlDeviceGetTemperatureV, 1, (nvmlDevice_t d, nvmlTemperature_t *t), (d, t)) {
    DEV(d);
    if (!t) return E_INVALID_ARGUMENT;
    if (t->version != (sizeof *t | 1u << 24)) return E_ARGUMENT_VERSION_MISMATCH;
    if (t->sensorType != 0) return E_INVALID_ARGUMENT;
    t->temperature = (int)gi(g, "temperature_c", 41);
    return OK;
}
API(nvmlDeviceGetTemperatureThreshold, 1, (nvmlDevice_t d, int kind, unsigned int *v),
    (d, kind, v)) {
    DEV(d);
    static const char *names[] = {"temperature_shutdown_c", "temperature_slowdown_c",
                                  "temperature_mem_max_c", "temperature_gpu_max_c"};
    static const long long dflt[] = {92, 90, 95, 87};
    if (kind < 0 || kind > 3) return E_NOT_SUPPORTED;
    return put_uint(v, gi(g, names[kind], dflt[kind]));
}
static nvmlReturn_t event_reasons(nvmlDevice_t d, unsigned long long *v) {
    DEV(d);
    if (!v) return E_INVALID_ARGUMENT;
    *v = (unsigned long long)gi(g, "clocks_event_reasons", 0x1 /* GpuIdle */);
    return OK;
}
API(nvmlDeviceGetCurrentClocksEventReasons, 1, (nvmlDevice_t d, unsigned long long *v), (d, v)) {
    return event_reasons(d, v);
}
API(nvmlDeviceGetCurrentClocksThrottleReasons, 1, (nvmlDevice_t d, unsigned long long *v),
    (d, v)) {
    return event_reasons(d, v);
}

API(nvmlDeviceGetComputeRunningProcesses_v3, 1,
    (nvmlDevice_t d, unsigned int *count, nvmlProcessInfo_t *infos), (d, count, infos)) {
    DEV(d);
    if (!count) return E_INVALID_ARGUMENT;
    char prefix[32];
    int plen = snprintf(prefix, sizeof prefix, "gpu%d.proc.", g);
    unsigned int n = 0;
    for (int i = 0; i < n_entries; i++) {
        char *dot;
        if (strncmp(keys[i], prefix, plen) != 0) continue;
        unsigned long pid = strtoul(keys[i] + plen, &dot, 10);
        if (strcmp(dot, ".used_bytes") != 0) continue;
        if (infos && n < *count) {
            infos[n].pid = (unsigned int)pid;
            /* NVML_VALUE_NOT_AVAILABLE: what NVML gives without the privilege to see it */
            infos[n].usedGpuMemory = strcmp(vals[i], "NA") == 0
                                         ? ~0ULL
                                         : strtoull(vals[i], NULL, 0);
            infos[n].gpuInstanceId = infos[n].computeInstanceId = 0xFFFFFFFFu;
        }
        n++;
    }
    /* nvml.h: INSUFFICIENT_SIZE with *infoCount set when the buffer is too small. */
    nvmlReturn_t r = (n > *count || (!infos && n > 0)) ? E_INSUFFICIENT_SIZE : OK;
    *count = n;
    return r;
}

API(nvmlDeviceGetTotalEccErrors, 1,
    (nvmlDevice_t d, int error_type, int counter_type, unsigned long long *v),
    (d, error_type, counter_type, v)) {
    DEV(d);
    if (!v || error_type < 0 || error_type > 1 || counter_type < 0 || counter_type > 1)
        return E_INVALID_ARGUMENT;
    char key[64];
    snprintf(key, sizeof key, "ecc.%s.%s", counter_type ? "aggregate" : "volatile",
             error_type ? "uncorrected" : "corrected");
    *v = (unsigned long long)gi(g, key, 0);
    return OK;
}
API(nvmlDeviceGetRetiredPagesPendingStatus, 1, (nvmlDevice_t d, int *pending), (d, pending)) {
    DEV(d);
    if (!pending) return E_INVALID_ARGUMENT;
    *pending = (int)gi(g, "retired_pages_pending", 0);
    return OK;
}
API(nvmlDeviceGetRemappedRows, 1,
    (nvmlDevice_t d, unsigned int *corr, unsigned int *unc, unsigned int *pending,
     unsigned int *failure),
    (d, corr, unc, pending, failure)) {
    DEV(d);
    if (!corr || !unc || !pending || !failure) return E_INVALID_ARGUMENT;
    *corr = (unsigned int)gi(g, "remap.corrected", 0);
    *unc = (unsigned int)gi(g, "remap.uncorrected", 0);
    *pending = (unsigned int)gi(g, "remap.pending", 0);
    *failure = (unsigned int)gi(g, "remap.failure", 0);
    return OK;
}
API(nvmlDeviceGetCurrPcieLinkWidth, 1, (nvmlDevice_t d, unsigned int *v), (d, v)) {
    DEV(d);
    return put_uint(v, gi(g, "pcie.width", 16));
}
API(nvmlDeviceGetMaxPcieLinkWidth, 1, (nvmlDevice_t d, unsigned int *v), (d, v)) {
    DEV(d);
    return put_uint(v, gi(g, "pcie.width_max", 16));
}
API(nvmlDeviceGetCurrPcieLinkGeneration, 1, (nvmlDevice_t d, unsigned int *v), (d, v)) {
    DEV(d);
    return put_uint(v, gi(g, "pcie.gen", 5));
}
API(nvmlDeviceGetMaxPcieLinkGeneration, 1, (nvmlDevice_t d, unsigned int *v), (d, v)) {
    DEV(d);
    return put_uint(v, gi(g, "pcie.gen_max", 5));
}
API(nvmlDeviceGetNvLinkState, 1, (nvmlDevice_t d, unsigned int link, int *active),
    (d, link, active)) {
    DEV(d);
    long long n = gi(g, "nvlink.count", 18);
    if (n <= 0) return E_NOT_SUPPORTED;
    if (!active || link >= (unsigned long long)n) return E_INVALID_ARGUMENT;
    *active = 1;
    const char *inactive = gv(g, "nvlink.inactive");
    for (const char *p = inactive; p && *p;) {
        char *end;
        unsigned long l = strtoul(p, &end, 10);
        if (end == p) break;
        if (l == link) *active = 0;
        p = *end == ',' ? end + 1 : end;
    }
    return OK;
}

API(nvmlEventSetCreate, 1, (nvmlEventSet_t *set), (set)) {
    if (!set) return E_INVALID_ARGUMENT;
    *set = calloc(1, sizeof **set);
    return *set ? OK : 20; /* NVML_ERROR_MEMORY */
}
API(nvmlDeviceRegisterEvents, 1, (nvmlDevice_t d, unsigned long long types, nvmlEventSet_t set),
    (d, types, set)) {
    DEV(d);
    if (!set) return E_INVALID_ARGUMENT;
    set->mask[g] |= types;
    return OK;
}

/* The n-th XID listed for GPU g, or 0 when the list is shorter. */
static unsigned long long nth_xid(int g, int n) {
    const char *p = gv(g, "xid");
    for (int i = 0; p && *p; i++) {
        char *end;
        unsigned long long x = strtoull(p, &end, 0);
        if (end == p) return 0;
        if (i == n) return x;
        p = *end == ',' ? end + 1 : end;
    }
    return 0;
}

static int take_event(nvmlEventSet_t set, nvmlEventData_t *data) {
    for (int g = 0; g < gpu_count(); g++) {
        unsigned long long xid;
        if (!(set->mask[g] & XID_EVENT) || lost[g]) continue;
        if ((xid = nth_xid(g, xids_delivered[g])) == 0) continue;
        xids_delivered[g]++;
        data->device = &devices[g];
        data->eventType = XID_EVENT;
        data->eventData = xid;
        data->gpuInstanceId = data->computeInstanceId = 0xFFFFFFFFu;
        return 1;
    }
    return 0;
}

API(nvmlEventSetWait_v2, 1, (nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeout_ms),
    (set, data, timeout_ms)) {
    if (!set || !data) return E_INVALID_ARGUMENT;
    for (unsigned int waited_ms = 0;; waited_ms += 10) {
        if (take_event(set, data)) return OK;
        if (waited_ms >= timeout_ms) return E_TIMEOUT;
        /* Sleep without the lock so other threads' calls go on, as in the driver. */
        pthread_mutex_unlock(&mu);
        usleep(10000);
        pthread_mutex_lock(&mu);
        reload();
    }
}
API(nvmlEventSetFree, 1, (nvmlEventSet_t set), (set)) {
    free(set);
    return OK;
}

API(nvmlGpmQueryDeviceSupport, 1, (nvmlDevice_t d, nvmlGpmSupport_t *s), (d, s)) {
    DEV(d);
    if (!s) return E_INVALID_ARGUMENT;
    if (s->version != 1) return E_ARGUMENT_VERSION_MISMATCH; /* NVML_GPM_SUPPORT_VERSION */
    s->isSupportedDevice = (unsigned int)gi(g, "gpm", 0);
    return OK;
}
API(nvmlGpmSampleAlloc, 1, (nvmlGpmSample_t *s), (s)) {
    if (!s) return E_INVALID_ARGUMENT;
    *s = calloc(1, sizeof **s);
    return *s ? OK : 20;
}
API(nvmlGpmSampleFree, 1, (nvmlGpmSample_t s), (s)) {
    free(s);
    return OK;
}
API(nvmlGpmSampleGet, 1, (nvmlDevice_t d, nvmlGpmSample_t s), (d, s)) {
    DEV(d);
    if (!s) return E_INVALID_ARGUMENT;
    if (!gi(g, "gpm", 0)) return E_NOT_SUPPORTED;
    s->gpu = g;
    s->taken = 1;
    return OK;
}
API(nvmlGpmMetricsGet, 1, (nvmlGpmMetricsGet_t *m), (m)) {
    if (!m || !m->sample1 || !m->sample2) return E_INVALID_ARGUMENT;
    if (m->version != 1) return E_ARGUMENT_VERSION_MISMATCH; /* NVML_GPM_METRICS_GET_VERSION */
    if (!m->sample1->taken || !m->sample2->taken || m->sample1->gpu != m->sample2->gpu)
        return E_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < m->numMetrics; i++) {
        char key[32];
        snprintf(key, sizeof key, "gpm.%u", m->metrics[i].metricId);
        const char *v = gv(m->sample1->gpu, key);
        m->metrics[i].nvmlReturn = OK;
        m->metrics[i].value = v ? strtod(v, NULL) : 0.0;
        m->metrics[i].metricInfo.shortName = m->metrics[i].metricInfo.longName = NULL;
        m->metrics[i].metricInfo.unit = NULL;
    }
    return OK;
}
