/* pshard_socket_ifname_address: PSHARD_SOCKET_IFNAME / --socket-ifname resolved to the
 * interface's IPv4 address, lists taking the first interface that has one, clear errors. */
#include <string.h>

#include "ps_test.h"
#include "pshard/collectives.h"

static void test_loopback(void)
{
    char addr[64] = "", err[512] = "";
    CU_ASSERT_EQUAL(pshard_socket_ifname_address("lo", addr, sizeof addr, err, sizeof err),
                    PSHARD_OK);
    CU_ASSERT_STRING_EQUAL(addr, "127.0.0.1");
    /* A list: the first that exists. */
    memset(addr, 0, sizeof addr);
    CU_ASSERT_EQUAL(
        pshard_socket_ifname_address("nosuch0,lo,eth0", addr, sizeof addr, err, sizeof err),
        PSHARD_OK);
    CU_ASSERT_STRING_EQUAL(addr, "127.0.0.1");
}

static void test_refused(void)
{
    char addr[64] = "", err[512] = "";
    CU_ASSERT_EQUAL(pshard_socket_ifname_address("nosuch0", addr, sizeof addr, err, sizeof err),
                    PSHARD_ERR_INVALID_ARGUMENT);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "'nosuch0'"));
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "lo")); /* what there is to choose from */
    /* A prefix of a name is not the name; empty items are skipped. */
    CU_ASSERT_EQUAL(pshard_socket_ifname_address("l,,", addr, sizeof addr, err, sizeof err),
                    PSHARD_ERR_INVALID_ARGUMENT);
    /* An output too small for the address is an error, not a cut address. */
    char tiny[4];
    CU_ASSERT_EQUAL(pshard_socket_ifname_address("lo", tiny, sizeof tiny, err, sizeof err),
                    PSHARD_ERR_INVALID_ARGUMENT);
}

int main(void)
{
    static const ps_test_case_t cases[] = {
        {"loopback and lists", test_loopback},
        {"unknown interfaces", test_refused},
        {NULL, NULL},
    };
    return ps_test_main("coll_ifname", cases);
}
