/* Logging: level and subsystem filters from the environment, and one write(2) per line with a
 * "host:pid:tid [role rank]" prefix so lines from many processes interleave cleanly. */
#include "pshard/log.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static atomic_int log_level = PS_LOG_WARN;
static atomic_uint log_subsys = PS_SUB_ALL;
static atomic_uint log_named = 0; /* named in PSHARD_LOG_SUBSYS (not through "^...") */
static atomic_int log_rank = -1;
static char log_role[32] = "pshard";
static char log_host[64] = "localhost";

static const char *const level_names[] = {"error", "warn", "info", "debug", "trace"};
static const char *const level_tags[] = {"ERROR", "WARN", "INFO", "DEBUG", "TRACE"};

static const struct {
    const char *name;
    unsigned bit;
} subsys_names[] = {
    {"main", PS_SUB_MAIN},   {"rpc", PS_SUB_RPC},     {"coll", PS_SUB_COLL},
    {"coord", PS_SUB_COORD}, {"shard", PS_SUB_SHARD}, {"client", PS_SUB_CLIENT},
    {"all", PS_SUB_ALL},
};

bool ps_log_parse_level(const char *text, ps_log_level_t *level)
{
    for (size_t i = 0; i < sizeof(level_names) / sizeof(level_names[0]); i++) {
        if (strcasecmp(text, level_names[i]) == 0) {
            *level = (ps_log_level_t)i;
            return true;
        }
    }
    return false;
}

/* Parses "rpc,coll" or "^rpc" (everything but rpc), as NCCL_DEBUG_SUBSYS does. */
static void parse_subsys(const char *text)
{
    bool invert = text[0] == '^';
    if (invert)
        text++;
    unsigned mask = 0;
    while (*text) {
        size_t len = strcspn(text, ",");
        bool found = false;
        for (size_t i = 0; i < sizeof(subsys_names) / sizeof(subsys_names[0]); i++) {
            if (strlen(subsys_names[i].name) == len &&
                strncasecmp(text, subsys_names[i].name, len) == 0) {
                mask |= subsys_names[i].bit;
                found = true;
            }
        }
        if (!found && len > 0)
            fprintf(stderr, "pshard: PSHARD_LOG_SUBSYS: unknown subsystem '%.*s' ignored\n",
                    (int)len, text);
        text += len;
        if (*text == ',')
            text++;
    }
    atomic_store(&log_subsys, invert ? ~mask : mask);
    atomic_store(&log_named, invert ? 0u : mask);
}

void ps_log_init(const char *role)
{
    if (role)
        snprintf(log_role, sizeof(log_role), "%s", role);
    if (gethostname(log_host, sizeof(log_host)) != 0)
        snprintf(log_host, sizeof(log_host), "localhost");
    log_host[sizeof(log_host) - 1] = '\0';
    const char *lvl = getenv("PSHARD_LOG");
    if (lvl && *lvl) {
        ps_log_level_t l;
        if (ps_log_parse_level(lvl, &l))
            atomic_store(&log_level, (int)l);
        else
            fprintf(stderr,
                    "pshard: PSHARD_LOG='%s' is not error|warn|info|debug|trace; using warn\n",
                    lvl);
    }
    const char *sub = getenv("PSHARD_LOG_SUBSYS");
    if (sub && *sub)
        parse_subsys(sub);
}

void ps_log_set_level(ps_log_level_t level)
{
    atomic_store(&log_level, (int)level);
}

void ps_log_set_rank(int rank)
{
    atomic_store(&log_rank, rank);
}

bool ps_log_enabled(ps_log_level_t level, unsigned subsys)
{
    return (int)level <= atomic_load(&log_level) &&
           (level == PS_LOG_ERROR || (atomic_load(&log_subsys) & subsys) != 0);
}

bool ps_log_named(ps_log_level_t level, unsigned subsys)
{
    return (atomic_load(&log_named) & subsys) != 0 && ps_log_enabled(level, subsys);
}

void ps_log_write(ps_log_level_t level, unsigned subsys, const char *file, int line,
                  const char *fmt, ...)
{
    char buf[2048];
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    int rank = atomic_load(&log_rank);
    char rank_text[16] = "";
    if (rank >= 0)
        snprintf(rank_text, sizeof(rank_text), " %d", rank);
    const char *base = strrchr(file, '/');
    base = base ? base + 1 : file;
    int n =
        snprintf(buf, sizeof(buf), "%02d:%02d:%02d.%03ld %s:%d:%ld [%s%s] %s %s:%d ", tm.tm_hour,
                 tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000, log_host, (int)getpid(),
                 (long)syscall(SYS_gettid), log_role, rank_text, level_tags[level], base, line);
    if (n < 0)
        return;
    if ((size_t)n >= sizeof(buf))
        n = sizeof(buf) - 1;
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(buf + n, sizeof(buf) - (size_t)n, fmt, ap);
    va_end(ap);
    size_t len = (size_t)n + (m > 0 ? (size_t)m : 0);
    if (len > sizeof(buf) - 2)
        len = sizeof(buf) - 2;
    buf[len++] = '\n';
    (void)subsys;
    ssize_t off = 0;
    while ((size_t)off < len) {
        ssize_t w = write(2, buf + off, len - (size_t)off);
        if (w <= 0)
            break;
        off += w;
    }
}
