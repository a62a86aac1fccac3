/* Logging for every pshard binary: levels and subsystems chosen by PSHARD_LOG and
 * PSHARD_LOG_SUBSYS (like NCCL_DEBUG / NCCL_DEBUG_SUBSYS), lines prefixed
 * "host:pid:tid [role rank]". The level is checked before anything is formatted. */
#ifndef PSHARD_LOG_H
#define PSHARD_LOG_H

#include <stdbool.h>

typedef enum {
    PS_LOG_ERROR = 0,
    PS_LOG_WARN = 1,
    PS_LOG_INFO = 2,
    PS_LOG_DEBUG = 3,
    PS_LOG_TRACE = 4,
} ps_log_level_t;

/* Subsystems are bits so PSHARD_LOG_SUBSYS can name several. */
typedef enum {
    PS_SUB_MAIN = 1u << 0,
    PS_SUB_RPC = 1u << 1,
    PS_SUB_COLL = 1u << 2,
    PS_SUB_COORD = 1u << 3,
    PS_SUB_SHARD = 1u << 4,
    PS_SUB_CLIENT = 1u << 5,
    PS_SUB_ALL = 0xffffffffu,
} ps_log_subsys_t;

/* Reads PSHARD_LOG and PSHARD_LOG_SUBSYS and records the role shown in each line's prefix.
 * Unknown level or subsystem names are reported once on stderr and ignored. Call once from
 * main() before other threads start; not thread-safe. */
void ps_log_init(const char *role);

/* Overrides the level (e.g. from a --log flag). Not thread-safe against concurrent logging
 * of the level itself, but a torn read only changes which lines print. */
void ps_log_set_level(ps_log_level_t level);

/* Parses "error|warn|info|debug|trace"; returns false for anything else. Thread-safe. */
bool ps_log_parse_level(const char *text, ps_log_level_t *level);

/* Sets the rank shown in the prefix (-1 for none). Thread-safe (atomic). */
void ps_log_set_rank(int rank);

/* True when a line at this level and subsystem would be printed. Thread-safe. */
bool ps_log_enabled(ps_log_level_t level, unsigned subsys);

/* True when a line at this level and subsystem would be printed and PSHARD_LOG_SUBSYS names the
 * subsystem (not just "everything"): for lines too many to print by default, such as one per
 * collective (as NCCL_DEBUG_SUBSYS=COLL). Thread-safe; two atomic loads when off. */
bool ps_log_named(ps_log_level_t level, unsigned subsys);

/* Writes one line to stderr. Use the PS_LOG_* macros, which check the level first.
 * Thread-safe: each line is written with a single write(2). */
void ps_log_write(ps_log_level_t level, unsigned subsys, const char *file, int line,
                  const char *fmt, ...) __attribute__((format(printf, 5, 6)));

#define PS_LOG_AT_(lvl, sub, ...)                                                                  \
    do {                                                                                           \
        if (ps_log_enabled((lvl), (sub)))                                                          \
            ps_log_write((lvl), (sub), __FILE__, __LINE__, __VA_ARGS__);                           \
    } while (0)
#define PS_ERROR(sub, ...) PS_LOG_AT_(PS_LOG_ERROR, (sub), __VA_ARGS__)
#define PS_WARN(sub, ...) PS_LOG_AT_(PS_LOG_WARN, (sub), __VA_ARGS__)
#define PS_INFO(sub, ...) PS_LOG_AT_(PS_LOG_INFO, (sub), __VA_ARGS__)
#define PS_DEBUG(sub, ...) PS_LOG_AT_(PS_LOG_DEBUG, (sub), __VA_ARGS__)
#define PS_TRACE(sub, ...) PS_LOG_AT_(PS_LOG_TRACE, (sub), __VA_ARGS__)

#endif
