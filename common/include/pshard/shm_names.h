/* Names of the POSIX shared-memory objects pshard creates in /dev/shm, and the sweep of those
 * that dead processes left: "/PREFIX-PID-NS-HEX" where PREFIX says whose ("pshard-srv" for a
 * shard server's model state, "pshard-trn" for a trainer's regions), PID the creator's, NS its
 * PID namespace's id in hex (so that a sweep judges only PIDs of its own namespace: a
 * container sharing /dev/shm has PIDs that mean nothing here) and HEX random. Thread-safe. */
#ifndef PSHARD_SHM_NAMES_H
#define PSHARD_SHM_NAMES_H

#include <stddef.h>

#define PS_SHM_SERVER "/pshard-srv-"
#define PS_SHM_TRAINER "/pshard-trn-"

/* This process's PID namespace's id ("pid:[ID]" in /proc/self/ns/pid), or 0 when unknown. */
unsigned long long ps_pid_ns(void);

/* A fresh name "PREFIXPID-NS-HEX" (prefix one of the above) into buf (>= 64 bytes). 0, or -1
 * when no random bytes could be had (errno set). */
int ps_shm_name(const char *prefix, char *buf, size_t len);

/* Removes what dead processes left in /dev/shm under prefix: regular files named exactly
 * "PREFIXPID-NS-HEX" of this PID namespace whose PID is not alive (kill(PID, 0) fails with
 * ESRCH: a live PID, even one reused since, keeps its object), owned by this user. Links and
 * other names are never touched. who names the creators in the log ("shard server").
 * Returns how many were removed; best effort, errors are logged. */
int ps_shm_sweep(const char *prefix, const char *who);

#endif
