/*
 * A machine out of inotify instances, for tests: preloaded into a process
 * (LD_PRELOAD), it makes inotify_init(2) and inotify_init1(2) fail with
 * EMFILE, as they do once a user has used up fs.inotify.max_user_instances
 * (128 by default; a busy Kubernetes node gets there). Built by the test
 * that uses it:
 *
 *     cc -shared -fPIC -o no_inotify.so no_inotify.c -ldl
 */
#include <errno.h>

int inotify_init(void) {
    errno = EMFILE;
    return -1;
}

int inotify_init1(int flags) {
    (void)flags;
    errno = EMFILE;
    return -1;
}
