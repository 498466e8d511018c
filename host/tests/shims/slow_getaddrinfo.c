/*
 * A DNS server slow to answer, for tests: preloaded into a process
 * (LD_PRELOAD), it makes getaddrinfo(3) of the host SLOW_GETADDRINFO_HOST
 * wait SLOW_GETADDRINFO_MS milliseconds and then answer 127.0.0.1. Each
 * such lookup appends a line to SLOW_GETADDRINFO_LOG when it starts:
 * "start N", N being how many were under way then, itself included.
 * Where SLOW_GETADDRINFO_CONTROL names a file, each such lookup reads it
 * first: "fail" makes the lookup fail at once (EAI_AGAIN, a DNS server
 * that cannot answer), and an IPv4 address makes it answer that address at
 * once; anything else, or no file, is the slow answer above.
 * Other lookups are left alone. Built by the test that uses it:
 *
 *     cc -shared -fPIC -o slow_getaddrinfo.so slow_getaddrinfo.c -ldl
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int under_way;

int getaddrinfo(const char *node, const char *service, const struct addrinfo *hints,
                struct addrinfo **res) {
    static int (*real)(const char *, const char *, const struct addrinfo *, struct addrinfo **);
    if (real == NULL) {
        real = dlsym(RTLD_NEXT, "getaddrinfo");
        if (real == NULL) {
            return EAI_FAIL;
        }
    }
    const char *slow = getenv("SLOW_GETADDRINFO_HOST");
    if (node == NULL || slow == NULL || strcmp(node, slow) != 0) {
        return real(node, service, hints, res);
    }
    int now = __atomic_add_fetch(&under_way, 1, __ATOMIC_SEQ_CST);
    const char *log = getenv("SLOW_GETADDRINFO_LOG");
    if (log != NULL) {
        FILE *file = fopen(log, "a");
        if (file != NULL) {
            fprintf(file, "start %d\n", now);
            fclose(file);
        }
    }
    char control[64] = "";
    const char *control_path = getenv("SLOW_GETADDRINFO_CONTROL");
    if (control_path != NULL) {
        FILE *file = fopen(control_path, "r");
        if (file != NULL) {
            size_t n = fread(control, 1, sizeof control - 1, file);
            control[n] = '\0';
            control[strcspn(control, "\r\n")] = '\0';
            fclose(file);
        }
    }
    struct in_addr parsed;
    if (strcmp(control, "fail") == 0 || inet_pton(AF_INET, control, &parsed) == 1) {
        __atomic_sub_fetch(&under_way, 1, __ATOMIC_SEQ_CST);
        return strcmp(control, "fail") == 0 ? EAI_AGAIN : real(control, service, hints, res);
    }
    const char *delay = getenv("SLOW_GETADDRINFO_MS");
    long millis = delay != NULL ? atol(delay) : 0;
    struct timespec wait = {millis / 1000, (millis % 1000) * 1000000L};
    while (nanosleep(&wait, &wait) != 0 && errno == EINTR) {
    }
    __atomic_sub_fetch(&under_way, 1, __ATOMIC_SEQ_CST);
    return real("127.0.0.1", service, hints, res);
}
