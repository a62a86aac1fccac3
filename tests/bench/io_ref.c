/* pshard-io-ref: the raw sequential I/O a checkpoint is compared with, dd-style, between the
 * same memory a shard server uses: `write FILE BYTES` writes BYTES from a touched buffer in 8 MiB
 * write(2)s and fsyncs; `read FILE` reads the whole file into a touched buffer of its size (a
 * server restores into its full-size state, not into one reused 8 MiB buffer as `dd` does).
 * Prints "MB/s ms bytes". */
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pshard/util.h"

#define CHUNK (8u << 20)

int main(int argc, char **argv)
{
    if (argc < 3 || (strcmp(argv[1], "write") == 0 && argc < 4)) {
        fprintf(stderr, "usage: pshard-io-ref write FILE BYTES | read FILE\n");
        return 2;
    }
    bool writing = strcmp(argv[1], "write") == 0;
    size_t bytes;
    int fd;
    if (writing) {
        bytes = (size_t)strtoull(argv[3], NULL, 10);
        fd = open(argv[2], O_WRONLY | O_CREAT | O_TRUNC, 0644);
    } else {
        struct stat st;
        fd = open(argv[2], O_RDONLY);
        bytes = fd >= 0 && fstat(fd, &st) == 0 ? (size_t)st.st_size : 0;
    }
    uint8_t *buf = malloc(bytes ? bytes : 1);
    if (fd < 0 || !buf) {
        perror(argv[2]);
        return 1;
    }
    memset(buf, 0x5a, bytes);
    int64_t t0 = ps_now_ns();
    for (size_t done = 0; done < bytes;) {
        size_t n = bytes - done < CHUNK ? bytes - done : CHUNK;
        ssize_t r = writing ? write(fd, buf + done, n) : read(fd, buf + done, n);
        if (r <= 0) {
            perror(argv[2]);
            return 1;
        }
        done += (size_t)r;
    }
    if (writing && fsync(fd) != 0) {
        perror("fsync");
        return 1;
    }
    int64_t t1 = ps_now_ns();
    close(fd);
    double ms = (double)(t1 - t0) / 1e6;
    printf("%.1f %.3f %zu\n", (double)bytes / ms / 1e3, ms, bytes);
    free(buf);
    return 0;
}
