/* A rendezvous file (init_method file://, as torch's): the coordinator writes "HOST:PORT\n"
 * into a file on a filesystem the trainers share, under an fcntl lock, and trainers read it
 * under a shared lock until it is there. Like torch's, the file must be absent or empty when a
 * coordinator claims it: leftover content (an earlier run that did not end cleanly, or another
 * coordinator using it) is refused, naming what is in it. A clean stop empties it again.
 * Whoever can write the file receives the cluster token (trainers send it to the address it
 * holds), so both sides refuse a file owned by another user than this one or root, or writable
 * by its group or others (PSHARD_ERR_PERMISSION), as ssh does with its keys; and a claim marks
 * the file at once (under the lock), so two coordinators started together cannot both have it.
 *
 * Thread safety: one ps_rdzv_file_t per thread. */
#ifndef PSHARD_RDZV_FILE_H
#define PSHARD_RDZV_FILE_H

#include <stddef.h>

#include "pshard/status.h"

typedef struct {
    int fd;         /* -1: none */
    char addr[300]; /* what was published ("" until then) */
} ps_rdzv_file_t;

/* Opens (creating, mode 0644; never following a link) and checks path: a regular file of this
 * user or root, not group- or other-writable (PERMISSION), empty; then marks it claimed (a line
 * "#claimed by pid N" that readers take for not yet published). INVALID_ARGUMENT naming the
 * content or the kind of file otherwise, SYSTEM on I/O errors. */
pshard_status_t ps_rdzv_file_claim(ps_rdzv_file_t *f, const char *path, char *err, size_t errlen);

/* Writes addr ("HOST:PORT") and a newline, synced, under an exclusive lock. */
pshard_status_t ps_rdzv_file_publish(ps_rdzv_file_t *f, const char *addr, char *err, size_t errlen);

/* Empties the file again if it still holds what this publish wrote, and closes it. */
void ps_rdzv_file_release(ps_rdzv_file_t *f);

/* Reads a published address (under a shared lock) into addr: PSHARD_OK, NOT_FOUND while the
 * file is absent, empty or only claimed, PERMISSION for a file another user (not root) owns or
 * that its group or others may write, INVALID_ARGUMENT when its content is not one HOST:PORT
 * line. */
pshard_status_t ps_rdzv_file_read(const char *path, char *addr, size_t addrlen, char *err,
                                  size_t errlen);

#endif
