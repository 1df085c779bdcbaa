/* LD_PRELOAD shim: a slow volume. Every stat or open of a path that ends with
 * $KVTIER_TEST_SLOW_SUFFIX (block files: ".kvb"; not their ".tmp" names) first sleeps
 * $KVTIER_TEST_SLOW_MS milliseconds: each lookup's stat and each load's open costs a
 * round trip of a busy network filesystem. Loaded only by tests/e2e/slow_volume.py's
 * engine process (tests/e2e/test_recompute_bound.py builds it). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

static void slow(const char *path)
{
    const char *suffix = getenv("KVTIER_TEST_SLOW_SUFFIX");
    const char *ms = getenv("KVTIER_TEST_SLOW_MS");
    if (!path || !suffix || !*suffix || !ms)
        return;
    size_t n = strlen(path), m = strlen(suffix);
    if (n < m || strcmp(path + n - m, suffix) != 0)
        return;
    long delay = atol(ms);
    struct timespec t = {delay / 1000, (delay % 1000) * 1000000L};
    while (nanosleep(&t, &t) != 0)
        ;
}

#define REAL(name) static __typeof__(&name) real_##name; \
    if (!real_##name) real_##name = (__typeof__(&name))dlsym(RTLD_NEXT, #name)

#define OPEN(name)                                                                       \
    int name(const char *path, int flags, ...)                                           \
    {                                                                                    \
        REAL(name);                                                                      \
        va_list ap;                                                                      \
        va_start(ap, flags);                                                             \
        mode_t mode = (flags & (O_CREAT | O_TMPFILE)) ? va_arg(ap, mode_t) : 0;          \
        va_end(ap);                                                                      \
        slow(path);                                                                      \
        return real_##name(path, flags, mode);                                           \
    }
OPEN(open)
OPEN(open64)

#define OPENAT(name)                                                                     \
    int name(int dir, const char *path, int flags, ...)                                  \
    {                                                                                    \
        REAL(name);                                                                      \
        va_list ap;                                                                      \
        va_start(ap, flags);                                                             \
        mode_t mode = (flags & (O_CREAT | O_TMPFILE)) ? va_arg(ap, mode_t) : 0;          \
        va_end(ap);                                                                      \
        slow(path);                                                                      \
        return real_##name(dir, path, flags, mode);                                      \
    }
OPENAT(openat)
OPENAT(openat64)

#define STAT(name, st_type)                                                              \
    int name(const char *path, st_type *st)                                              \
    {                                                                                    \
        REAL(name);                                                                      \
        slow(path);                                                                      \
        return real_##name(path, st);                                                    \
    }
STAT(stat, struct stat)
STAT(stat64, struct stat64)
STAT(lstat, struct stat)
STAT(lstat64, struct stat64)

#define FSTATAT(name, st_type)                                                           \
    int name(int dir, const char *path, st_type *st, int flags)                          \
    {                                                                                    \
        REAL(name);                                                                      \
        slow(path);                                                                      \
        return real_##name(dir, path, st, flags);                                        \
    }
FSTATAT(fstatat, struct stat)
FSTATAT(fstatat64, struct stat64)
