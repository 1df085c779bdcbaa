/* LD_PRELOAD shim: a network filesystem's stale name, as GlusterFS shows it after
 * another node replaced a file. Every file whose path contains $KVTIER_TEST_ESTALE opens,
 * but its first fstat or read fails with ESTALE, and so does every later open of the
 * same name, until that name has been stat'ed (a stat by name makes the kernel look the
 * name up afresh there). Loaded only by tests/offload/test_estale.py's subprocesses.
 *
 * With $KVTIER_TEST_RACE set to a count n (1 where it is not a number), it also plays
 * another node creating the same names at once: the first n mkdirs of each name fail with
 * ENOENT, the first n creates (opens with O_CREAT) of each name with ESTALE; the next try
 * of the same name works ($KVTIER_TEST_RACE_EEXIST: mkdir_race_errno). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#define MAX_FD 4096
#define MAX_NAMES 1024

static char stale_fd[MAX_FD];
static char *fresh[MAX_NAMES]; /* names stat'ed since: opens of them are fine */
static int fresh_count;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static int matches(const char *path)
{
    const char *pattern = getenv("KVTIER_TEST_ESTALE");
    return path && pattern && *pattern && strstr(path, pattern);
}

static int is_fresh(const char *path)
{
    int found = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < fresh_count && !found; i++)
        found = strcmp(fresh[i], path) == 0;
    pthread_mutex_unlock(&lock);
    return found;
}

static void stat_by_name(const char *path)
{
    if (!matches(path) || is_fresh(path))
        return;
    pthread_mutex_lock(&lock);
    if (fresh_count < MAX_NAMES)
        fresh[fresh_count++] = strdup(path);
    pthread_mutex_unlock(&lock);
}

static char *raced[MAX_NAMES]; /* names whose mkdir or create failed already */
static int raced_times[MAX_NAMES]; /* how many times each */
static int raced_count;

/* Whether this mkdir or create of path is to fail (one of its first n, under
 * $KVTIER_TEST_RACE=n). */
static int first_race(const char *path)
{
    const char *race = getenv("KVTIER_TEST_RACE");
    int times = race ? atoi(race) : 0, fail = 0, i;
    if (!race || !path)
        return 0;
    if (times < 1)
        times = 1;
    pthread_mutex_lock(&lock);
    for (i = 0; i < raced_count && strcmp(raced[i], path) != 0; i++)
        ;
    if (i == raced_count && raced_count < MAX_NAMES) {
        raced[raced_count] = strdup(path);
        raced_times[raced_count++] = 0;
    }
    if (i < raced_count && raced_times[i] < times) {
        raced_times[i]++;
        fail = 1;
    }
    pthread_mutex_unlock(&lock);
    return fail;
}

/* What a racing mkdir fails with: ENOENT, or with $KVTIER_TEST_RACE_EEXIST set EEXIST
 * (the directory not made all the same: what GlusterFS answered once while the other
 * node looked the name up; every open of it then failed with ENOENT). */
static int mkdir_race_errno(void)
{
    return getenv("KVTIER_TEST_RACE_EEXIST") ? EEXIST : ENOENT;
}

static int opened(int fd, const char *path)
{
    if (fd >= 0 && fd < MAX_FD)
        stale_fd[fd] = matches(path) && !is_fresh(path);
    return fd;
}

static int stale(int fd)
{
    if (fd >= 0 && fd < MAX_FD && stale_fd[fd]) {
        errno = ESTALE;
        return 1;
    }
    return 0;
}

#define REAL(name) static __typeof__(&name) real_##name; \
    if (!real_##name) real_##name = (__typeof__(&name))dlsym(RTLD_NEXT, #name)

#define OPEN(name)                                                                       \
    int name(const char *path, int flags, ...)                                           \
    {                                                                                    \
        REAL(name);                                     \
        va_list ap;                                                                      \
        va_start(ap, flags);                                                             \
        mode_t mode = (flags & (O_CREAT | O_TMPFILE)) ? va_arg(ap, mode_t) : 0;          \
        va_end(ap);                                                                      \
        if ((flags & O_CREAT) && first_race(path)) {                                     \
            errno = ESTALE;                                                              \
            return -1;                                                                   \
        }                                                                                \
        return opened(real_##name(path, flags, mode), path);                             \
    }
OPEN(open)
OPEN(open64)

#define OPENAT(name)                                                                     \
    int name(int dir, const char *path, int flags, ...)                                  \
    {                                                                                    \
        REAL(name);                                \
        va_list ap;                                                                      \
        va_start(ap, flags);                                                             \
        mode_t mode = (flags & (O_CREAT | O_TMPFILE)) ? va_arg(ap, mode_t) : 0;          \
        va_end(ap);                                                                      \
        if ((flags & O_CREAT) && first_race(path)) {                                     \
            errno = ESTALE;                                                              \
            return -1;                                                                   \
        }                                                                                \
        return opened(real_##name(dir, path, flags, mode), path);                        \
    }
OPENAT(openat)
OPENAT(openat64)

int mkdir(const char *path, mode_t mode)
{
    REAL(mkdir);
    if (first_race(path)) {
        errno = mkdir_race_errno();
        return -1;
    }
    return real_mkdir(path, mode);
}

int mkdirat(int dir, const char *path, mode_t mode)
{
    REAL(mkdirat);
    if (first_race(path)) {
        errno = mkdir_race_errno();
        return -1;
    }
    return real_mkdirat(dir, path, mode);
}

int close(int fd)
{
    REAL(close);
    if (fd >= 0 && fd < MAX_FD)
        stale_fd[fd] = 0;
    return real_close(fd);
}

#define FSTAT(name, st_type)                                                             \
    int name(int fd, st_type *st)                                                        \
    {                                                                                    \
        REAL(name);                                             \
        return stale(fd) ? -1 : real_##name(fd, st);                                     \
    }
FSTAT(fstat, struct stat)
FSTAT(fstat64, struct stat64)

#define STAT(name, st_type)                                                              \
    int name(const char *path, st_type *st)                                              \
    {                                                                                    \
        REAL(name);                                    \
        stat_by_name(path);                                                              \
        return real_##name(path, st);                                                    \
    }
STAT(stat, struct stat)
STAT(stat64, struct stat64)
STAT(lstat, struct stat)
STAT(lstat64, struct stat64)

#define FSTATAT(name, st_type)                                                           \
    int name(int dir, const char *path, st_type *st, int flags)                          \
    {                                                                                    \
        REAL(name);                          \
        if (*path)                                                                       \
            stat_by_name(path);                                                          \
        else if (stale(dir))                                                             \
            return -1;                                                                   \
        return real_##name(dir, path, st, flags);                                        \
    }
FSTATAT(fstatat, struct stat)
FSTATAT(fstatat64, struct stat64)

#define READS(name, args, call, fd_arg, ret)                                             \
    ret name args                                                                        \
    {                                                                                    \
        REAL(name);                                                         \
        return stale(fd_arg) ? -1 : real_##name call;                                    \
    }
READS(read, (int fd, void *buf, size_t n), (fd, buf, n), fd, ssize_t)
READS(pread, (int fd, void *buf, size_t n, off_t at), (fd, buf, n, at), fd, ssize_t)
READS(pread64, (int fd, void *buf, size_t n, off_t at), (fd, buf, n, at), fd, ssize_t)
READS(readv, (int fd, const struct iovec *v, int n), (fd, v, n), fd, ssize_t)
READS(preadv, (int fd, const struct iovec *v, int n, off_t at), (fd, v, n, at), fd, ssize_t)
READS(preadv64, (int fd, const struct iovec *v, int n, off_t at), (fd, v, n, at), fd, ssize_t)
READS(preadv2, (int fd, const struct iovec *v, int n, off_t at, int f), (fd, v, n, at, f), fd,
      ssize_t)
