/* A slower disk for benchmarks: fsync and fdatasync sleep
 * FENCEPOST_BENCH_FSYNC_DELAY_US after the real call (cloud block storage
 * takes 1-3 ms where this VM's disk takes 0.2).
 *
 *   cc -O2 -shared -fPIC -o /tmp/slow_fsync.so bench/slow_fsync.c -ldl
 *   LD_PRELOAD=/tmp/slow_fsync.so FENCEPOST_BENCH_FSYNC_DELAY_US=2000 \
 *       .venv/bin/python bench/peers --backends fencepost-engine,redis
 *
 * Every process the bench starts inherits it (Go's etcd does not call libc
 * and is not slowed). Not for production. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <unistd.h>

static long delay_us(void) {
    static long us = -1;
    if (us < 0) {
        const char *s = getenv("FENCEPOST_BENCH_FSYNC_DELAY_US");
        us = s ? atol(s) : 0;
    }
    return us;
}

int fsync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    int rc = real(fd);
    if (delay_us() > 0) usleep((useconds_t)delay_us());
    return rc;
}

int fdatasync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    int rc = real(fd);
    if (delay_us() > 0) usleep((useconds_t)delay_us());
    return rc;
}
