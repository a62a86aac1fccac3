/* Unit tests for pshard/rdzv_file.h: a claim refuses a file with content (naming it) and other
 * kinds of file and is exclusive at once, publish writes one line that read gives back,
 * release empties only what it wrote, read refuses content that is not one HOST:PORT line, and
 * both refuse another user's file or one others may write. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ps_test.h"
#include "pshard/rdzv_file.h"

static char dir[64];

static void path_of(char *buf, size_t len, const char *name)
{
    snprintf(buf, len, "%s/%s", dir, name);
}

static void put(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    CU_ASSERT_FATAL(f != NULL);
    fputs(text, f);
    fclose(f);
}

static void test_round_trip(void)
{
    char path[128], addr[64] = "", err[512] = "";
    path_of(path, sizeof path, "rt");
    CU_ASSERT_EQUAL(ps_rdzv_file_read(path, addr, sizeof addr, err, sizeof err),
                    PSHARD_ERR_NOT_FOUND); /* absent */
    ps_rdzv_file_t f;
    CU_ASSERT_EQUAL_FATAL(ps_rdzv_file_claim(&f, path, err, sizeof err), PSHARD_OK);
    CU_ASSERT_EQUAL(ps_rdzv_file_read(path, addr, sizeof addr, err, sizeof err),
                    PSHARD_ERR_NOT_FOUND); /* empty */
    CU_ASSERT_EQUAL(ps_rdzv_file_publish(&f, "node-3.example:29500", err, sizeof err), PSHARD_OK);
    CU_ASSERT_EQUAL(ps_rdzv_file_read(path, addr, sizeof addr, err, sizeof err), PSHARD_OK);
    CU_ASSERT_STRING_EQUAL(addr, "node-3.example:29500");
    /* A second claim while it holds an address is refused, naming it. */
    ps_rdzv_file_t g;
    err[0] = '\0';
    CU_ASSERT_EQUAL(ps_rdzv_file_claim(&g, path, err, sizeof err), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "'node-3.example:29500'"));
    ps_rdzv_file_release(&f);
    struct stat st;
    CU_ASSERT(stat(path, &st) == 0 && st.st_size == 0);
    /* Released: it can be claimed again. */
    CU_ASSERT_EQUAL(ps_rdzv_file_claim(&g, path, err, sizeof err), PSHARD_OK);
    ps_rdzv_file_release(&g); /* nothing published: its claim is taken back */
    CU_ASSERT(stat(path, &st) == 0 && st.st_size == 0);
    unlink(path);
}

/* Two coordinators started together: the claim is exclusive at once, before any publish, and
 * a reader meanwhile sees "not yet". */
static void test_claim_is_exclusive(void)
{
    char path[128], addr[64] = "", err[512] = "";
    path_of(path, sizeof path, "excl");
    ps_rdzv_file_t f, g;
    CU_ASSERT_EQUAL_FATAL(ps_rdzv_file_claim(&f, path, err, sizeof err), PSHARD_OK);
    err[0] = '\0';
    CU_ASSERT_EQUAL(ps_rdzv_file_claim(&g, path, err, sizeof err), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "#claimed by pid"));
    err[0] = '\0';
    CU_ASSERT_EQUAL(ps_rdzv_file_read(path, addr, sizeof addr, err, sizeof err),
                    PSHARD_ERR_NOT_FOUND);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "has not published"));
    CU_ASSERT_EQUAL(ps_rdzv_file_publish(&f, "h:1", err, sizeof err), PSHARD_OK);
    CU_ASSERT_EQUAL(ps_rdzv_file_read(path, addr, sizeof addr, err, sizeof err), PSHARD_OK);
    CU_ASSERT_STRING_EQUAL(addr, "h:1");
    ps_rdzv_file_release(&f);
    unlink(path);
}

/* Whoever can write the file gets the cluster token: a file others may write, or another
 * user's, is refused by the reader and by a claim. */
static void test_owner_and_mode(void)
{
    char path[128], addr[64] = "", err[512] = "";
    path_of(path, sizeof path, "perm");
    put(path, "evil.example:443\n");
    CU_ASSERT_FATAL(chmod(path, 0666) == 0);
    err[0] = '\0';
    CU_ASSERT_EQUAL(ps_rdzv_file_read(path, addr, sizeof addr, err, sizeof err),
                    PSHARD_ERR_PERMISSION);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "writable by others (mode 666)"));
    CU_ASSERT_FATAL(chmod(path, 0620) == 0);
    CU_ASSERT_EQUAL(ps_rdzv_file_read(path, addr, sizeof addr, err, sizeof err),
                    PSHARD_ERR_PERMISSION);
    put(path, "");
    ps_rdzv_file_t f;
    err[0] = '\0';
    CU_ASSERT_EQUAL(ps_rdzv_file_claim(&f, path, err, sizeof err), PSHARD_ERR_PERMISSION);
    CU_ASSERT_FATAL(chmod(path, 0644) == 0);
    if (geteuid() == 0) { /* another user's file (root can make one) */
        put(path, "evil.example:443\n");
        CU_ASSERT_FATAL(chown(path, 4242, 4242) == 0);
        err[0] = '\0';
        CU_ASSERT_EQUAL(ps_rdzv_file_read(path, addr, sizeof addr, err, sizeof err),
                        PSHARD_ERR_PERMISSION);
        CU_ASSERT_PTR_NOT_NULL(strstr(err, "owned by uid 4242"));
        put(path, "");
        CU_ASSERT_EQUAL(ps_rdzv_file_claim(&f, path, err, sizeof err), PSHARD_ERR_PERMISSION);
    }
    unlink(path);
}

static void test_release_keeps_what_others_wrote(void)
{
    char path[128], err[512] = "";
    path_of(path, sizeof path, "other");
    ps_rdzv_file_t f;
    CU_ASSERT_EQUAL_FATAL(ps_rdzv_file_claim(&f, path, err, sizeof err), PSHARD_OK);
    CU_ASSERT_EQUAL(ps_rdzv_file_publish(&f, "a:1", err, sizeof err), PSHARD_OK);
    put(path, "b:2\n"); /* someone replaced it */
    ps_rdzv_file_release(&f);
    char addr[64] = "";
    CU_ASSERT_EQUAL(ps_rdzv_file_read(path, addr, sizeof addr, err, sizeof err), PSHARD_OK);
    CU_ASSERT_STRING_EQUAL(addr, "b:2");
    unlink(path);
}

static void test_bad_content_and_kinds(void)
{
    char path[128], addr[64] = "", err[512] = "";
    path_of(path, sizeof path, "bad");
    static const char *const bad[] = {"no-port\n", "host:\n",    "host:0\n", "host:70000\n",
                                      ":29500\n",  "a:1\nb:2\n", "\n"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        put(path, bad[i]);
        err[0] = '\0';
        CU_ASSERT_EQUAL(ps_rdzv_file_read(path, addr, sizeof addr, err, sizeof err),
                        PSHARD_ERR_INVALID_ARGUMENT);
        CU_ASSERT_PTR_NOT_NULL(strstr(err, "not one HOST:PORT line"));
    }
    /* Control bytes in the content are not echoed. */
    put(path, "x\033[2J:1\n");
    ps_rdzv_file_t f;
    err[0] = '\0';
    CU_ASSERT_EQUAL(ps_rdzv_file_claim(&f, path, err, sizeof err), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NULL(strchr(err, '\033'));
    unlink(path);
    /* A directory, and a link (never followed). */
    char sub[128], link[128];
    path_of(sub, sizeof sub, "sub");
    CU_ASSERT_FATAL(mkdir(sub, 0700) == 0);
    CU_ASSERT_EQUAL(ps_rdzv_file_claim(&f, sub, err, sizeof err), PSHARD_ERR_SYSTEM);
    /* A FIFO would read as empty for ever: refused by both sides. */
    char fifo[128];
    path_of(fifo, sizeof fifo, "fifo");
    CU_ASSERT_FATAL(mkfifo(fifo, 0600) == 0);
    char addr2[64];
    err[0] = '\0';
    CU_ASSERT_EQUAL(ps_rdzv_file_read(fifo, addr2, sizeof addr2, err, sizeof err),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "not a regular file"));
    err[0] = '\0';
    CU_ASSERT_EQUAL(ps_rdzv_file_claim(&f, fifo, err, sizeof err), PSHARD_ERR_INVALID_ARGUMENT);
    unlink(fifo);
    path_of(link, sizeof link, "link");
    CU_ASSERT_FATAL(symlink(sub, link) == 0);
    err[0] = '\0';
    CU_ASSERT_EQUAL(ps_rdzv_file_claim(&f, link, err, sizeof err), PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "symbolic link"));
    unlink(link);
    rmdir(sub);
}

int main(void)
{
    snprintf(dir, sizeof dir, "/tmp/pshard-rdzv-XXXXXX");
    if (!mkdtemp(dir))
        return 1;
    static const ps_test_case_t cases[] = {
        {"claim, publish, read, release", test_round_trip},
        {"release keeps what another wrote", test_release_keeps_what_others_wrote},
        {"bad content, directories and links", test_bad_content_and_kinds},
        {"a claim is exclusive at once", test_claim_is_exclusive},
        {"another user's or a group/other-writable file is refused", test_owner_and_mode},
        {NULL, NULL},
    };
    int rc = ps_test_main("common_rdzv_file", cases);
    rmdir(dir);
    return rc;
}
