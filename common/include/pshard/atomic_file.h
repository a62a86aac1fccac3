/* Writing a file whole, atomically: the bytes go to a fresh temporary ".NAME.tmp-<random>" in
 * the same directory, created with O_EXCL (so never an existing file or a planted link), which
 * is synced and renamed over NAME only once everything was written, and the directory is synced
 * after. On any failure the temporary is removed and a file already called NAME is untouched, so
 * a reader sees the old file or the whole new one. Checkpoint manifests, shard files,
 * safetensors exports and port files are all written this way.
 *
 * Thread safety: reentrant; one ps_atomic_file_t is used by one thread at a time. */
#ifndef PSHARD_ATOMIC_FILE_H
#define PSHARD_ATOMIC_FILE_H

#include <limits.h>
#include <stdbool.h>
#include <stddef.h>

#include "pshard/status.h"

typedef struct {
    int dfd, fd;    /* the directory and the temporary (-1 once closed) */
    bool own_dfd;   /* dfd was opened by ps_atomic_file_open_path and is closed by commit */
    char tmp[300];  /* the temporary's name in dfd */
    char name[256]; /* the final name in dfd */
    char shown[PATH_MAX];
} ps_atomic_file_t;

/* Creates the temporary for file `name` of directory dfd (borrowed: it must stay open until
 * ps_atomic_file_commit) with mode 0644; shown is the path messages use. Errors: SYSTEM,
 * INVALID_ARGUMENT (name too long); nothing needs committing then. */
pshard_status_t ps_atomic_file_open(int dfd, const char *name, const char *shown,
                                    ps_atomic_file_t *f, char *err, size_t errlen);

/* The same for a path: its directory is opened (links in the path are followed: it is the
 * caller's own path) and closed again by ps_atomic_file_commit. Errors as above. */
pshard_status_t ps_atomic_file_open_path(const char *path, ps_atomic_file_t *f, char *err,
                                         size_t errlen);

/* Appends len bytes (retrying short writes). Errors: SYSTEM naming the file. */
pshard_status_t ps_atomic_file_write(ps_atomic_file_t *f, const void *buf, size_t len, char *err,
                                     size_t errlen);

/* ok: fsync, rename over the final name, fsync of the directory. !ok, or any failure on the
 * way: the temporary is removed (and OK is returned for !ok). Closes everything either way;
 * calling it again does nothing. */
pshard_status_t ps_atomic_file_commit(ps_atomic_file_t *f, bool ok, char *err, size_t errlen);

/* open, write and commit of a whole buffer as file `name` of directory dfd. */
pshard_status_t ps_atomic_file_put(int dfd, const char *name, const char *shown, const void *data,
                                   size_t len, char *err, size_t errlen);

/* write(2) of all len bytes to fd, retrying on EINTR and short writes (a write of 0 bytes is
 * ENOSPC). Errors: SYSTEM naming shown. */
pshard_status_t ps_write_all(int fd, const void *buf, size_t len, const char *shown, char *err,
                             size_t errlen);

/* Writes "PORT\n" to path atomically so a reader never sees a partial
 * file. Errors: SYSTEM, INVALID_ARGUMENT (not a file path), naming path. */
pshard_status_t ps_write_port_file(const char *path, int port, char *err, size_t errlen);

/* What a daemon does once it serves: writes the bound port to port_file (if non-NULL) and
 * prints "listening on HOST:PORT" (HOST from listen, "HOST:PORT") to stdout, the line scripts
 * wait for. Returns 0, or -1 with a message on stderr when the port file cannot be written. */
int ps_announce_listening(const char *prog, const char *listen, int port, const char *port_file);

#endif
