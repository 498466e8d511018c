/*
 * A disk that is slow to sync, or fails to, for tests: preloaded into a
 * process (LD_PRELOAD), it changes what fdatasync(2) does.
 *
 *   SLOW_FDATASYNC_MS=N       each fdatasync waits N milliseconds before
 *                             doing the real one; the data still reaches
 *                             the disk.
 *   FAIL_FDATASYNC_WHILE=PATH while PATH exists, fdatasync fails with EIO
 *                             (what a failing device reports) without
 *                             syncing; once PATH is removed, it syncs again.
 *   HOLD_FSYNC_WHILE=PATH     while PATH exists, fsync(2) waits (a hung
 *                             volume), looking every 10 ms; once PATH is
 *                             removed, it syncs.
 *
 * Nothing else changes. Built by the tests that use it, with the machine's
 * C compiler:
 *
 *     cc -shared -fPIC -o faulty_fdatasync.so faulty_fdatasync.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

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
    const char *failing = getenv("FAIL_FDATASYNC_WHILE");
    if (failing != NULL && access(failing, F_OK) == 0) {
        errno = EIO;
        return -1;
    }
    return real(fd);
}

int fsync(int fd) {
    static int (*real)(int);
    if (real == NULL) {
        real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
        if (real == NULL) {
            errno = ENOSYS;
            return -1;
        }
    }
    const char *hold = getenv("HOLD_FSYNC_WHILE");
    while (hold != NULL && access(hold, F_OK) == 0) {
        struct timespec wait = {0, 10 * 1000000L};
        nanosleep(&wait, NULL);
    }
    return real(fd);
}
