/*
 * A disk that is slow to sync, for tests: preloaded into a process
 * (LD_PRELOAD), it makes each fdatasync(2) wait SLOW_FDATASYNC_MS
 * milliseconds before doing the real one. Nothing else changes: the data
 * still reaches the disk. Built by the test that uses it, with the
 * machine's C compiler:
 *
 *     cc -shared -fPIC -o slow_fdatasync.so slow_fdatasync.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <time.h>

int fdatasync(int fd) {
    static int (*real)(int);
    if (real == NULL) {
        real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
        if (real == NULL) {
            errno = ENOSYS;
            return -1;
        }
    }
    const char *delay = getenv("SLOW_FDATASYNC_MS");
    if (delay != NULL) {
        long millis = atol(delay);
        struct timespec wait = {millis / 1000, (millis % 1000) * 1000000L};
        while (nanosleep(&wait, &wait) != 0 && errno == EINTR) {
        }
    }
    return real(fd);
}
